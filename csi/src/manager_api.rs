//! The manager's REST API as the plugin uses it: typed calls over `corral_api::client::Client` (volumes, nodes,
//! snapshots, backing images, backups and restores) and waits for a volume to reach a state (polling with a
//! deadline).

use std::time::{Duration, Instant};

use corral_api::backup::{BackupTargetView, BackupView, RestoreView};
use corral_api::client::{Client, ClientError};
use corral_api::clone::CloneStatusView;
use corral_api::model::VolumeState;
use corral_api::node::NodeView;
use corral_api::volume::{SnapshotView, VolumeView};
use serde::Deserialize;
use serde_json::json;

use crate::error::{CsiError, CsiResult};

/// A volume as the manager shows it, with its clone (`dataSource`, `cloneStatus`) when it is one.
#[derive(Debug, Clone)]
pub struct ManagedVolume {
    pub view: VolumeView,
    /// `vol://NAME` or `snap://NAME/SNAP` when the volume was created from one.
    pub data_source: Option<String>,
    pub clone: Option<CloneStatusView>,
}

impl From<VolumeView> for ManagedVolume {
    fn from(view: VolumeView) -> Self {
        Self {
            data_source: view.data_source.clone().filter(|s| !s.is_empty()),
            clone: view.clone_status.clone(),
            view,
        }
    }
}

/// What a new volume should be.
#[derive(Debug, Clone)]
pub struct VolumeRequest {
    pub name: String,
    pub size: u64,
    pub number_of_replicas: Option<u32>,
    pub disable_revision_counter: Option<bool>,
    pub data_source: Option<String>,
    /// Restore this completed backup (`TARGET:BACKUP`) into the new volume.
    pub from_backup: Option<String>,
    pub backing_image: Option<String>,
}

/// A backing image as far as the plugin cares: whether volumes can use it yet.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageState {
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub progress: u32,
    #[serde(default)]
    pub message: String,
}

#[derive(Clone)]
pub struct ManagerApi {
    client: Client,
}

fn not_found(e: &ClientError) -> bool {
    matches!(e, ClientError::Api { status: 404, .. })
}

impl ManagerApi {
    /// The manager at `url`, presenting `token` (the manager's API token) with every call.
    pub fn new(url: &str, token: Option<String>) -> Self {
        Self {
            client: Client::new(url).with_token(token),
        }
    }

    pub fn url(&self) -> &str {
        self.client.base()
    }

    pub async fn healthy(&self) -> CsiResult<()> {
        let nodes: Vec<NodeView> = self.client.get("/v1/nodes").await?;
        let _ = nodes;
        Ok(())
    }

    pub async fn volume(&self, name: &str) -> CsiResult<Option<ManagedVolume>> {
        match self
            .client
            .get::<VolumeView>(&format!("/v1/volumes/{name}"))
            .await
        {
            Ok(v) => Ok(Some(v.into())),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn volumes(&self) -> CsiResult<Vec<ManagedVolume>> {
        let views: Vec<VolumeView> = self.client.get("/v1/volumes").await?;
        Ok(views.into_iter().map(ManagedVolume::from).collect())
    }

    pub async fn node(&self, name: &str) -> CsiResult<Option<NodeView>> {
        match self.client.get(&format!("/v1/nodes/{name}")).await {
            Ok(n) => Ok(Some(n)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn nodes(&self) -> CsiResult<Vec<NodeView>> {
        Ok(self.client.get("/v1/nodes").await?)
    }

    pub async fn create_volume(&self, req: &VolumeRequest) -> CsiResult<ManagedVolume> {
        let mut body = json!({"name": req.name, "size": req.size});
        if let Some(n) = req.number_of_replicas {
            body["numberOfReplicas"] = json!(n);
        }
        if let Some(d) = req.disable_revision_counter {
            body["disableRevisionCounter"] = json!(d);
        }
        if let Some(src) = &req.data_source {
            body["dataSource"] = json!(src);
        }
        if let Some(b) = &req.from_backup {
            body["fromBackup"] = json!(b);
        }
        if let Some(bi) = &req.backing_image {
            body["backingImage"] = json!(bi);
        }
        let view: VolumeView = self.client.post("/v1/volumes", &body).await?;
        Ok(view.into())
    }

    pub async fn backing_image(&self, name: &str) -> CsiResult<Option<BackingImageState>> {
        match self.client.get(&format!("/v1/backingimages/{name}")).await {
            Ok(b) => Ok(Some(b)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn create_backing_image(
        &self,
        name: &str,
        source_type: &str,
        parameters: &std::collections::BTreeMap<String, String>,
    ) -> CsiResult<()> {
        let body = json!({"name": name, "sourceType": source_type, "parameters": parameters});
        let _: serde_json::Value = self.client.post("/v1/backingimages", &body).await?;
        Ok(())
    }

    pub async fn delete_volume(&self, name: &str) -> CsiResult<()> {
        match self.client.delete(&format!("/v1/volumes/{name}")).await {
            Ok(()) => Ok(()),
            Err(e) if not_found(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks for the volume on `node` (None: the answering manager's node).
    pub async fn attach(&self, name: &str, node: Option<&str>) -> CsiResult<()> {
        let body = json!({"nodeId": node});
        let _: serde_json::Value = self
            .client
            .post(&format!("/v1/volumes/{name}/attach"), &body)
            .await?;
        Ok(())
    }

    /// Attaches on the answering manager's node without a frontend (maintenance mode): the engine runs for a
    /// backup, nobody can reach the volume for IO.
    pub async fn attach_without_frontend(&self, name: &str) -> CsiResult<()> {
        let _: serde_json::Value = self
            .client
            .post(
                &format!("/v1/volumes/{name}/attach"),
                &json!({"disableFrontend": true}),
            )
            .await?;
        Ok(())
    }

    pub async fn detach(&self, name: &str) -> CsiResult<()> {
        let _: serde_json::Value = self
            .client
            .post(&format!("/v1/volumes/{name}/detach"), &json!({}))
            .await?;
        Ok(())
    }

    pub async fn expand(&self, name: &str, size: u64) -> CsiResult<()> {
        let _: serde_json::Value = self
            .client
            .post(&format!("/v1/volumes/{name}/expand"), &json!({"size": size}))
            .await?;
        Ok(())
    }

    pub async fn snapshots(&self, volume: &str) -> CsiResult<Vec<SnapshotView>> {
        // Listing an attached volume's snapshots also records them in the manager's store, and that write can
        // lose an optimistic-concurrency race with the manager's own recording (409 "changed since it was
        // read"): the list itself is fine, so ask again (for up to ~5 s on a busy machine).
        let mut attempt: u64 = 0;
        loop {
            match self.client.get(&format!("/v1/volumes/{volume}/snapshots")).await {
                Err(ClientError::Api { status: 409, .. }) if attempt < 30 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20 * attempt.min(10))).await;
                }
                r => return Ok(r?),
            }
        }
    }

    pub async fn create_snapshot(&self, volume: &str, name: &str) -> CsiResult<()> {
        let _: serde_json::Value = self
            .client
            .post(&format!("/v1/volumes/{volume}/snapshots"), &json!({"name": name}))
            .await?;
        Ok(())
    }

    pub async fn delete_snapshot(&self, volume: &str, name: &str) -> CsiResult<()> {
        Ok(self
            .client
            .delete(&format!("/v1/volumes/{volume}/snapshots/{name}"))
            .await?)
    }

    pub async fn backup_target(&self, name: &str) -> CsiResult<Option<BackupTargetView>> {
        match self.client.get(&format!("/v1/backuptargets/{name}")).await {
            Ok(t) => Ok(Some(t)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Every backup of every target the manager knows.
    pub async fn backups(&self) -> CsiResult<Vec<BackupView>> {
        Ok(self.client.get("/v1/backups").await?)
    }

    pub async fn backup(&self, target: &str, name: &str) -> CsiResult<Option<BackupView>> {
        match self.client.get(&format!("/v1/backups/{target}:{name}")).await {
            Ok(b) => Ok(Some(b)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Backs the (attached) volume up to `target`; the manager takes the snapshot it reads.
    pub async fn create_backup(
        &self,
        volume: &str,
        target: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> CsiResult<BackupView> {
        Ok(self
            .client
            .post(
                "/v1/backups",
                &json!({"volume": volume, "target": target, "labels": labels}),
            )
            .await?)
    }

    /// Deletes a backup; one already gone is deleted.
    pub async fn delete_backup(&self, target: &str, name: &str) -> CsiResult<()> {
        match self.client.delete(&format!("/v1/backups/{target}:{name}")).await {
            Ok(()) => Ok(()),
            Err(e) if not_found(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The volume's restore from a backup, if it has one.
    pub async fn restore(&self, volume: &str) -> CsiResult<Option<RestoreView>> {
        match self.client.get(&format!("/v1/volumes/{volume}/restore")).await {
            Ok(r) => Ok(Some(r)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Polls until `done` holds for the volume, failing after `timeout` with DEADLINE_EXCEEDED (the CO retries
    /// the call, which finds the state reached or keeps waiting).
    pub async fn wait_volume(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&ManagedVolume) -> bool,
    ) -> CsiResult<ManagedVolume> {
        let end = Instant::now() + timeout;
        loop {
            let v = self.volume(name).await?.ok_or_else(|| {
                CsiError::NotFound(format!("volume {name} disappeared while waiting until {what}"))
            })?;
            if done(&v) {
                return Ok(v);
            }
            if Instant::now() >= end {
                return Err(CsiError::DeadlineExceeded(format!(
                    "volume {name} is not {what} after {timeout:?} (state {:?}, message {:?})",
                    v.view.state, v.view.message
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Attached on `node` with its NBD endpoints published.
    pub async fn wait_attached(&self, name: &str, node: &str, timeout: Duration) -> CsiResult<ManagedVolume> {
        self.wait_volume(name, &format!("attached on {node}"), timeout, |v| {
            v.view.state == VolumeState::Attached
                && v.view.current_node_id.as_deref() == Some(node)
                && !v.view.endpoints.is_empty()
        })
        .await
    }

    pub async fn wait_detached(&self, name: &str, timeout: Duration) -> CsiResult<ManagedVolume> {
        self.wait_volume(name, "detached", timeout, |v| {
            v.view.node_id.is_none() && v.view.state == VolumeState::Detached
        })
        .await
    }
}
