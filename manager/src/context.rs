//! What every part of one node's manager shares: the store, who this node is, where its daemons' binaries and
//! data live, and the daemons it knows it started.

use std::path::PathBuf;
use std::sync::Arc;

use crate::model::Setting;
use crate::store::Db;

/// Static configuration of one node's manager.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    /// Host the node's daemons listen on and other nodes reach them at.
    pub host: String,
    /// Host of the storage network: the data path (replicas' control, data and sync listeners, v2 lvstore
    /// daemons, engines' NBD TCP frontends) listens there and is reached there. `host` when no separate one.
    pub storage_host: String,
    /// `http://HOST:PORT` of this manager's REST API.
    pub address: String,
    pub data_dir: PathBuf,
    /// Directory holding `corral-replica` and `corral-engine`.
    pub bin_dir: PathBuf,
    /// Ports `corral-bim` sync receivers lease: [from, to). Every daemon listener is bound on port 0 (or the port
    /// it reported before) instead.
    pub port_range: (u16, u16),
    /// Where the node's daemons run: children of this manager, or the node's instance manager.
    pub processes: crate::process::ProcessHost,
    /// This manager's build version, written into the node's status by every heartbeat.
    pub version: String,
}

#[derive(Clone)]
pub struct Ctx {
    pub db: Db,
    pub cfg: Arc<NodeConfig>,
    pub metrics: crate::metrics::Metrics,
}

impl Ctx {
    pub fn new(db: Db, cfg: NodeConfig) -> Self {
        Self {
            db,
            cfg: Arc::new(cfg),
            metrics: crate::metrics::Metrics::default(),
        }
    }

    /// The value of a setting, or its default.
    pub async fn setting(&self, name: &str) -> String {
        if let Ok(Some(s)) = self.db.get::<Setting>(name).await {
            return s.data.value;
        }
        crate::model::SETTINGS
            .iter()
            .find(|s| s.0 == name)
            .map(|s| s.1.to_owned())
            .unwrap_or_default()
    }

    pub async fn setting_bool(&self, name: &str) -> bool {
        self.setting(name).await == "true"
    }

    pub async fn setting_u64(&self, name: &str) -> u64 {
        self.setting(name).await.parse().unwrap_or(0)
    }
}
