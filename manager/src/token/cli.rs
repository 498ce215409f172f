//! `corral token create|list|revoke` (admin), and how every `corral` command finds its token:
//! `--token-file` (`CORRAL_TOKEN_FILE`), else `CORRAL_TOKEN`, else `DATA_DIR/admin.token` (`CORRAL_DATA_DIR`, default `./corral-data`:
//! where `corral up` and the quick start put the manager's data).

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::model::Role;
use super::routes::{TokenCreate, TokenCreated, TokenView};
use super::{BOOTSTRAP_FILE, bootstrap};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Create a token and print its secret (shown this once; store it now): `corral token create ci --role operator`.
    Create {
        name: String,
        /// admin (everything), operator (volumes, snapshots, backups, jobs, backing images; no settings, backup
        /// targets, tokens or node changes), viewer (read only).
        #[arg(long, value_enum)]
        role: Role,
    },
    /// List the tokens: name, role, created, last used (never a secret).
    #[command(alias = "ls")]
    List,
    /// Revoke a token: requests presenting it are refused from now on.
    #[command(alias = "rm")]
    Revoke { name: String },
}

pub async fn run(c: &Client, json: bool, cmd: TokenCmd) -> anyhow::Result<()> {
    use corral_daemon::output::{print, table};
    match cmd {
        TokenCmd::Create { name, role } => {
            let t: TokenCreated = c.post("/v1/tokens", &TokenCreate { name, role }).await?;
            print(json, &t, || {
                eprintln!(
                    "token {} ({}) created; its secret is shown this once:",
                    t.view.name, t.view.role
                );
                format!("{}\n", t.token)
            })?;
        }
        TokenCmd::List => {
            let ts: Vec<TokenView> = c.get("/v1/tokens").await?;
            print(json, &ts, || {
                table(
                    &["NAME", "ROLE", "CREATED", "LAST USED"],
                    ts.iter()
                        .map(|t| {
                            vec![
                                t.name.clone(),
                                t.role.to_string(),
                                t.created.clone(),
                                if t.last_used.is_empty() {
                                    "never".into()
                                } else {
                                    t.last_used.clone()
                                },
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })?;
        }
        TokenCmd::Revoke { name } => c.delete(&format!("/v1/tokens/{name}")).await?,
    }
    Ok(())
}

/// The token `corral` presents: `--token-file`, else `$CORRAL_TOKEN`, else the data directory's
/// [`BOOTSTRAP_FILE`] when it exists (none: requests go without one, and the manager says what is missing).
pub fn find_token(
    token_file: Option<&Path>,
    env_token: Option<String>,
    data_dir: &Path,
) -> anyhow::Result<Option<String>> {
    if let Some(f) = token_file {
        return bootstrap::read_token_file(f).map(Some);
    }
    if let Some(t) = env_token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()) {
        return Ok(Some(t));
    }
    let f: PathBuf = data_dir.join(BOOTSTRAP_FILE);
    if f.exists() {
        return bootstrap::read_token_file(&f).map(Some);
    }
    Ok(None)
}
