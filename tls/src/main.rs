//! `corral-tls`: create a cluster CA and issue node certificates by hand (debugging, a daemon started without the
//! manager). Parses flags and wires; the work is in the library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_tls::{CA_DAYS, ClusterCa, LEAF_DAYS, LeafRequest, SubjectAltName, TlsDir};

#[derive(Parser, Debug)]
#[command(
    name = "corral-tls",
    version,
    about = "Corral cluster CA and node certificates for mutual TLS between daemons"
)]
struct Cli {
    #[command(flatten)]
    log: corral_daemon::cli::LogArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The cluster CA.
    Ca {
        #[command(subcommand)]
        cmd: CaCmd,
    },
    /// Issue a node certificate signed by the CA in --ca and write ca.crt, tls.crt and tls.key (mode 0600) into
    /// OUT: a directory a daemon takes as --tls-dir.
    Issue {
        /// The CA directory (`ca init`'s DIR).
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        /// The certificate's common name (the node or daemon; shown in logs).
        #[arg(long)]
        name: String,
        /// A DNS name or IP address peers reach the node by (repeat, or comma-separate). A client checks the name
        /// it dialled against these.
        #[arg(long = "san", value_name = "NAME|IP", value_delimiter = ',', required = true)]
        sans: Vec<SubjectAltName>,
        /// Validity in days.
        #[arg(long, default_value_t = LEAF_DAYS)]
        days: u32,
        /// Output directory (created if missing; files in it are replaced).
        out: PathBuf,
    },
    /// Make OUT the certificate directory of an NBD client (qemu's `tls-creds-x509,endpoint=client,dir=OUT`,
    /// libnbd's `nbds://HOST:PORT/VOL?tls-certificates=OUT`): ca-cert.pem, client-cert.pem and client-key.pem,
    /// symlinks to the files of --tls-dir (checked first), so re-issued certificates are picked up.
    NbdClientDir {
        /// The node's directory (ca.crt, tls.crt, tls.key) whose certificate the client presents.
        #[arg(long = "tls-dir", value_name = "DIR")]
        tls_dir: PathBuf,
        /// The client directory (created if missing; the three links in it are replaced).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Load a --tls-dir as a daemon would and report whether it is usable.
    Check {
        /// The directory holding ca.crt, tls.crt and tls.key.
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum CaCmd {
    /// Create a cluster CA (ECDSA P-256): ca.crt and ca.key (mode 0600) in DIR. Refuses to replace one.
    Init {
        /// The CA's common name.
        #[arg(long, default_value = "Corral cluster CA")]
        name: String,
        /// Validity in days.
        #[arg(long, default_value_t = CA_DAYS)]
        days: u32,
        /// Output directory (created if missing).
        dir: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.log.init(RunKind::Command)?;
    match cli.cmd {
        Cmd::Ca {
            cmd: CaCmd::Init { name, days, dir },
        } => {
            let ca = ClusterCa::generate(&name, days).context("create the cluster CA")?;
            ca.write(&dir)?;
            println!("cluster CA written to {}", dir.display());
        }
        Cmd::Issue {
            ca,
            name,
            sans,
            days,
            out,
        } => {
            let ca = ClusterCa::load(&ca)?;
            let cert = ca.issue(&LeafRequest::new(name.as_str(), sans, days))?;
            cert.write(&out)?;
            println!("certificate for {name} written to {}", out.display());
        }
        Cmd::NbdClientDir { tls_dir, out } => {
            let tls = TlsDir::load(&tls_dir)?;
            tls.client_config()?;
            tls.link_nbd_client_dir(&out)?;
            println!(
                "NBD client directory {} links to {} (qemu: tls-creds-x509,endpoint=client,dir=...; libnbd: \
                 nbds://HOST:PORT/VOLUME?tls-certificates=...)",
                out.display(),
                tls_dir.display()
            );
        }
        Cmd::Check { dir } => {
            let tls = TlsDir::load(&dir)?;
            tls.server_config()?;
            tls.client_config()?;
            println!("{}: usable", dir.display());
        }
    }
    Ok(())
}
