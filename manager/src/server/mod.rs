//! Wires one node's manager: opens the store, registers the node (with a default disk under the data directory
//! on first start), starts the node-local controllers, campaigns for leadership of the cluster-wide ones, and
//! serves the REST API ([`routes`]: every feature's routes). Stopping the manager leaves the daemons running: the
//! next start re-adopts them.

pub mod routes;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, NodeConfig};
use crate::model::{DiskSpec, Node, NodeSpec};
use crate::store::{Db, StoreError};

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// `embedded` or `etcd://HOST:PORT[,HOST:PORT]`.
    pub store: String,
    pub node_id: String,
    /// Host daemons listen on (reachable by the other nodes).
    pub host: String,
    /// `--storage-host`: the address on the storage network, where replicas' listeners and engines' NBD
    /// frontends go instead of `host` (None: `host`; the management traffic stays on `host`).
    pub storage_host: Option<String>,
    pub bin_dir: PathBuf,
    pub port_range: (u16, u16),
    /// Where to write the ready report (`corral_daemon::ready`).
    pub ready_file: Option<PathBuf>,
    /// URL of the node's instance manager; None: the manager runs the daemons itself.
    pub instance_manager: Option<String>,
    /// This manager's build version, which the node reports (`corral node ls`).
    pub version: String,
    /// Where the first admin token goes on an empty token store (None: DATA_DIR/admin.token); a token already
    /// in that file (a mounted Secret) is adopted instead of a new one.
    pub admin_token_file: Option<PathBuf>,
    /// `--tls-dir`: the manager's gRPC clients are mutual TLS (the process's configs, installed by `main`)
    /// and every daemon it runs itself gets it as `CORRAL_TLS_DIR` (through an instance manager, that one's own).
    pub tls_dir: Option<PathBuf>,
    /// `--tls auto`: the node's certificate is issued from the store's cluster CA into DATA_DIR/tls (see
    /// [`crate::pki`]), which then serves as `tls_dir`.
    pub tls_auto: bool,
}

/// How long a starting manager waits for its instance manager to answer (both may start together).
const INSTANCE_MANAGER_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The directory of the running executable: where the workspace puts `corral-replica` and `corral-engine` too.
pub fn default_bin_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(std::path::Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The URL other nodes reach this manager's REST API at: the listener's address, or, when it listens on every
/// interface (`0.0.0.0`, `::`), the node's `--host` with the listener's port (a wildcard is no address to call).
fn advertised_address(local: std::net::SocketAddr, host: &str) -> String {
    if !local.ip().is_unspecified() {
        return format!("http://{local}");
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(ip)) => format!("http://[{ip}]:{}", local.port()),
        _ => format!("http://{host}:{}", local.port()),
    }
}

async fn register_node(db: &Db, cfg: &ServerConfig, address: &str) -> Result<(), StoreError> {
    loop {
        match db.get::<Node>(&cfg.node_id).await? {
            Some(mut n) => {
                if n.data.spec.address == address && n.data.spec.host == cfg.host {
                    return Ok(());
                }
                n.data.spec.address = address.to_owned();
                n.data.spec.host.clone_from(&cfg.host);
                match db.update(&mut n).await {
                    Err(StoreError::Conflict { .. }) => continue,
                    r => return r,
                }
            }
            None => {
                let disk_path = cfg.data_dir.join("disks").join("default");
                let uuid = corral_disk::identity::read_disk_config(&disk_path)
                    .map_or_else(|_| uuid::Uuid::new_v4().to_string(), |c| c.disk_uuid);
                let spec = NodeSpec {
                    address: address.to_owned(),
                    host: cfg.host.clone(),
                    allow_scheduling: true,
                    disks: [(
                        "default".to_owned(),
                        DiskSpec {
                            path: disk_path.display().to_string(),
                            disk_uuid: uuid,
                            allow_scheduling: true,
                            storage_reserved: 0,
                            engine: crate::model::DataEngine::V1,
                            lvstore_size: 0,
                        },
                    )]
                    .into_iter()
                    .collect(),
                    drain_requested: false,
                };
                match db
                    .create(
                        &cfg.node_id,
                        Node {
                            spec,
                            status: Default::default(),
                        },
                    )
                    .await
                {
                    Err(StoreError::AlreadyExists { .. }) => continue,
                    r => return r.map(|_| ()),
                }
            }
        }
    }
}

/// `corral-manager --tls-issue-only`: the node's TLS directory issued (or kept) from the store's cluster CA (made
/// when the store has none), nothing served; returns the directory.
pub async fn issue_node_tls(cfg: &ServerConfig) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| format!("create {}", cfg.data_dir.display()))?;
    let data_dir = cfg.data_dir.canonicalize()?;
    let store = crate::store::open(&cfg.store, &data_dir)
        .await
        .with_context(|| format!("open store {}", cfg.store))?;
    let db = Db::new(store);
    crate::pki::ensure_node_dir(
        &db,
        &data_dir,
        &cfg.node_id,
        &cfg.host,
        cfg.storage_host.as_deref(),
    )
    .await
}

pub async fn run(cfg: ServerConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    corral_disk::identity::check_path_component("node id", &cfg.node_id).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| format!("create {}", cfg.data_dir.display()))?;
    let data_dir = cfg.data_dir.canonicalize()?;
    let cfg = ServerConfig { data_dir, ..cfg };
    tracing::info!(?cfg, "corral-manager starting");
    let store = crate::store::open(&cfg.store, &cfg.data_dir)
        .await
        .with_context(|| format!("open store {}", cfg.store))?;
    let db = Db::new(store);
    // Before anything opens a gRPC channel (the instance manager's is the first).
    let cfg = if cfg.tls_auto {
        let dir = crate::pki::ensure_node_dir(
            &db,
            &cfg.data_dir,
            &cfg.node_id,
            &cfg.host,
            cfg.storage_host.as_deref(),
        )
        .await?;
        corral_tls::TlsDirArg {
            tls_dir: Some(dir.clone()),
        }
        .load_and_install()?;
        ServerConfig {
            tls_dir: Some(dir),
            ..cfg
        }
    } else {
        cfg
    };
    let processes = match &cfg.instance_manager {
        None => crate::process::ProcessHost::Local {
            bin_dir: cfg.bin_dir.clone(),
            tls_dir: cfg.tls_dir.clone(),
        },
        Some(url) => {
            let im = crate::instance_manager::InstanceManager::connect_retrying(url, INSTANCE_MANAGER_WAIT)
                .await?;
            tracing::info!(
                url,
                version = im.version,
                api = im.api_version,
                "daemons run in the instance manager"
            );
            crate::process::ProcessHost::InstanceManager(im)
        }
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listen on {}", cfg.listen))?;
    let address = advertised_address(listener.local_addr()?, &cfg.host);
    register_node(&db, &cfg, &address).await?;
    let token_file = cfg
        .admin_token_file
        .clone()
        .unwrap_or_else(|| cfg.data_dir.join(crate::token::BOOTSTRAP_FILE));
    crate::token::bootstrap::ensure_admin_token(&db, &token_file).await?;
    let ctx = Ctx::new(
        db.clone(),
        NodeConfig {
            node_id: cfg.node_id.clone(),
            host: cfg.host.clone(),
            storage_host: cfg.storage_host.clone().unwrap_or_else(|| cfg.host.clone()),
            address: address.clone(),
            data_dir: cfg.data_dir.clone(),
            bin_dir: cfg.bin_dir.clone(),
            port_range: cfg.port_range,
            processes,
            version: cfg.version.clone(),
        },
    );
    crate::controller::node::heartbeat_once(&ctx).await?;
    crate::controller::node::start_heartbeat(&ctx, &cancel);
    crate::controller::replica::start(&ctx, &cancel);
    crate::controller::engine::start(&ctx, &cancel);
    crate::controller::orphans::start(&ctx, &cancel);
    crate::v2::controller::start(&ctx, &cancel);
    crate::backing_image::start_node(&ctx, &cancel);
    crate::backup::start_node(&ctx, &cancel);
    let leader_ctx = ctx.clone();
    let leader_cancel = cancel.clone();
    let node_id = cfg.node_id.clone();
    tokio::spawn(async move {
        loop {
            let lead = tokio::select! {
                () = leader_cancel.cancelled() => return,
                r = leader_ctx.db.raw().campaign(&node_id) => r,
            };
            match lead {
                Ok(lost) => {
                    tracing::info!(node = node_id, "leading the cluster-wide controllers");
                    let scope = leader_cancel.child_token();
                    crate::volume::controller::start(&leader_ctx, &scope);
                    crate::controller::node::start_failure_detector(&leader_ctx, &scope);
                    crate::backing_image::start_leader(&leader_ctx, &scope);
                    crate::clone::controller::start(&leader_ctx, &scope);
                    crate::job::controller::start(&leader_ctx, &scope);
                    crate::backup::start_leader(&leader_ctx, &scope);
                    tokio::select! {
                        () = leader_cancel.cancelled() => { lost.cancel(); scope.cancel(); return }
                        () = lost.cancelled() => { scope.cancel(); tracing::warn!("lost leadership") }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "campaign failed; retrying");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    });
    tracing::info!(%address, node = cfg.node_id, store = ctx.db.raw().backend(), "REST API listening");
    corral_daemon::ready::ReadyReport::new()
        .tcp("http", listener.local_addr()?)
        .announce(cfg.ready_file.as_deref())?;
    let app = crate::ui::router(ctx.clone())
        .merge(crate::api::router(ctx.clone(), routes::routes()))
        .layer(axum::middleware::from_fn_with_state(
            ctx,
            crate::token::auth::require_token,
        ));
    let c = cancel.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { c.cancelled().await })
        .await?;
    tracing::info!("manager stopped; daemons keep running and are re-adopted at the next start");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::advertised_address;

    #[test]
    fn a_wildcard_listener_is_advertised_at_the_node_host() {
        assert_eq!(
            advertised_address("127.0.0.1:9500".parse().unwrap(), "10.0.0.5"),
            "http://127.0.0.1:9500"
        );
        assert_eq!(
            advertised_address("0.0.0.0:9500".parse().unwrap(), "10.0.0.5"),
            "http://10.0.0.5:9500"
        );
        assert_eq!(
            advertised_address("[::]:9500".parse().unwrap(), "fd00::5"),
            "http://[fd00::5]:9500"
        );
        assert_eq!(
            advertised_address("0.0.0.0:9500".parse().unwrap(), "node-1"),
            "http://node-1:9500"
        );
    }
}
