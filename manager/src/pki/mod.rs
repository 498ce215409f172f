//! The cluster CA kept in the store, and the node certificate each manager issues itself from it
//! (`corral-manager --tls auto`). The CA is one document (kind [`ClusterCaDoc::KIND`], name [`CA_NAME`]) made by
//! the first manager to start with a create-if-absent: two managers starting together on one etcd agree on one CA
//! (the loser reads the winner's). Its key leaves the store only into this process's memory: no log line, error,
//! REST route or UI shows it (`Debug` redacts it). A node's directory ([`NODE_DIR`] in the data directory: `ca.crt`,
//! `tls.crt`, `tls.key` 0600, the directory 0700) is issued anew at start when missing, not the store CA's, not
//! naming the node's addresses, or within a third of its validity of expiry.

use std::path::{Path, PathBuf};

use anyhow::Context;
use corral_tls::{CA_DAYS, ClusterCa, LEAF_DAYS, LeafRequest, SubjectAltName};
use serde::{Deserialize, Serialize};

use crate::store::{Db, Resource, StoreError};

/// The name of the one cluster CA document.
pub const CA_NAME: &str = "cluster";
/// The node's TLS directory under the manager's data directory.
pub const NODE_DIR: &str = "tls";
/// The cluster CA certificate's common name.
const CA_COMMON_NAME: &str = "Corral cluster CA";

/// The cluster CA in the store: its certificate and private key in PEM.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterCaDoc {
    pub cert_pem: String,
    pub key_pem: String,
    /// RFC 3339.
    pub created: String,
}

impl std::fmt::Debug for ClusterCaDoc {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCaDoc")
            .field("created", &self.created)
            .finish_non_exhaustive()
    }
}

impl Resource for ClusterCaDoc {
    const KIND: &'static str = "cluster-ca";
}

/// The cluster CA: the store's, or a new one stored with a create-if-absent when there is none (another manager
/// creating one at the same moment wins, and this one reads it).
pub async fn ensure_ca(db: &Db) -> anyhow::Result<ClusterCa> {
    let doc = match db.get::<ClusterCaDoc>(CA_NAME).await? {
        Some(doc) => doc.data,
        None => {
            let ca = ClusterCa::generate(CA_COMMON_NAME, CA_DAYS).context("generate the cluster CA")?;
            let doc = ClusterCaDoc {
                cert_pem: ca.cert_pem().to_owned(),
                key_pem: ca.key_pem().to_owned(),
                created: chrono::Utc::now().to_rfc3339(),
            };
            match db.create(CA_NAME, doc).await {
                Ok(_) => {
                    tracing::info!("created the cluster CA in the store");
                    return Ok(ca);
                }
                Err(StoreError::AlreadyExists { .. }) => db.must_get::<ClusterCaDoc>(CA_NAME).await?.data,
                Err(e) => return Err(e.into()),
            }
        }
    };
    Ok(ClusterCa::from_pem(
        doc.cert_pem,
        doc.key_pem,
        "the store's cluster CA",
    )?)
}

/// What a node's certificate names: `host` and `storage_host` (what its peers dial: the manager its daemons at
/// the host, engines replicas at the storage host), 127.0.0.1 (where a node's manager dials its instance manager,
/// which listens on the node's loopback in the deployments) and the node id when it is a DNS name.
pub fn node_request(node_id: &str, host: &str, storage_host: Option<&str>) -> LeafRequest {
    let mut names: Vec<SubjectAltName> = Vec::new();
    for name in [Some(host), storage_host, Some("127.0.0.1"), Some(node_id)]
        .into_iter()
        .flatten()
    {
        let Ok(san) = name.parse::<SubjectAltName>() else {
            continue;
        };
        let is_dns_ok = match &san {
            SubjectAltName::Ip(_) => true,
            SubjectAltName::Dns(d) => corral_tls::rustls::pki_types::DnsName::try_from(d.as_str()).is_ok(),
        };
        if is_dns_ok && !names.contains(&san) {
            names.push(san);
        }
    }
    LeafRequest::new(node_id, names, LEAF_DAYS)
}

/// Makes `DATA_DIR/tls` hold this node's certificate from the store's CA (creating the CA on a new cluster) and
/// returns the directory, to be loaded as `--tls-dir` is.
pub async fn ensure_node_dir(
    db: &Db,
    data_dir: &Path,
    node_id: &str,
    host: &str,
    storage_host: Option<&str>,
) -> anyhow::Result<PathBuf> {
    let ca = ensure_ca(db).await?;
    let dir = data_dir.join(NODE_DIR);
    let req = node_request(node_id, host, storage_host);
    if let Some(why) = ca.ensure_node_dir(&dir, &req)? {
        tracing::info!(dir = %dir.display(), node = node_id, reason = why, "issued the node's certificate");
    }
    Ok(dir)
}
