//! The volume routes' views built from the store's documents. The JSON shapes themselves (volumes, their snapshots
//! and replicas, the requests) live in `corral_api::volume`, re-exported here.

pub use corral_api::volume::{
    AttachRequest, EngineView, ReplicaView, SizeRequest, SnapshotCreate, SnapshotView, VolumeCreate,
    VolumeView,
};

use crate::clone::views::CloneStatusView;
use crate::model::{Replica, Robustness, Volume};
use crate::store::Object;

impl From<&Object<Replica>> for ReplicaView {
    fn from(o: &Object<Replica>) -> Self {
        let r = &o.data;
        Self {
            name: o.name.clone(),
            volume: r.spec.volume.clone(),
            node_id: r.spec.node_id.clone(),
            disk: r.spec.disk.clone(),
            data_path: r.spec.data_path.clone(),
            data_engine: r.spec.data_engine,
            state: r.status.state,
            desire_state: r.spec.desire_state,
            mode: r.status.mode.clone(),
            rebuild_progress: None,
            address: r.status.address.clone(),
            pid: r.status.process.as_ref().map(|p| p.pid),
            failed: r.spec.failed_at.is_some(),
            message: r.status.message.clone(),
        }
    }
}

/// `view` with its clone record, when the volume is a clone.
#[must_use]
pub fn with_clone(mut view: VolumeView, c: Option<&crate::clone::model::VolumeClone>) -> VolumeView {
    view.data_source = c.map(|c| c.data_source.clone());
    view.clone_status = c.map(CloneStatusView::from);
    view
}

/// The view of a volume from its document, its engine's and its replicas' (the others in `replicas` are skipped).
pub fn volume_view(
    v: &Object<Volume>,
    engine: Option<&Object<crate::model::Engine>>,
    replicas: &[Object<Replica>],
) -> VolumeView {
    let d = &v.data;
    VolumeView {
        name: v.name.clone(),
        size: d.spec.size,
        number_of_replicas: d.spec.number_of_replicas,
        frontend: d.spec.frontend,
        data_engine: d.spec.data_engine,
        disable_revision_counter: d.spec.disable_revision_counter,
        revision_counter_disabled: d.status.revision_counter_disabled,
        node_id: d.spec.node_id.clone(),
        current_node_id: d.status.current_node_id.clone(),
        state: d.status.state,
        // The stored robustness was derived from the engine at the controller's last pass; an engine that
        // has (re)started since and is not serving yet makes it unknown now, as that pass will find.
        robustness: match engine {
            Some(e) if e.data.status.state != crate::model::ProcessState::Running => Robustness::Unknown,
            _ => d.status.robustness,
        },
        endpoints: d.status.endpoints.clone(),
        disable_frontend: d.spec.disable_frontend,
        frontend_disabled: d.status.frontend_disabled,
        salvage_requested: d.spec.salvage_requested,
        message: d.status.message.clone(),
        backing_image: d.spec.backing_image.clone(),
        engine: engine.map(|e| EngineView {
            node_id: e.data.spec.node_id.clone(),
            state: e.data.status.state,
            address: e.data.status.address.clone(),
            pid: e.data.status.process.as_ref().map(|p| p.pid),
            restarts: e.data.status.process.as_ref().map_or(0, |p| p.restarts),
            generation: e.data.status.generation,
            last_fenced: e.data.status.last_fenced.clone(),
        }),
        replicas: replicas
            .iter()
            .filter(|r| r.data.spec.volume == v.name)
            .map(|r| {
                let mut view = ReplicaView::from(r);
                view.rebuild_progress = engine.and_then(|e| {
                    e.data
                        .status
                        .rebuild_progress
                        .get(&r.data.status.address)
                        .copied()
                });
                view
            })
            .collect(),
        data_source: None,
        clone_status: None,
        engine_generation: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Engine, ProcessState};

    #[test]
    fn a_volume_reads_its_stored_robustness_only_while_its_engine_runs() {
        let mut v = Object {
            name: "v".to_owned(),
            version: 1,
            data: Volume::default(),
        };
        v.data.status.robustness = Robustness::Healthy;
        let mut e = Object {
            name: "v".to_owned(),
            version: 1,
            data: Engine::default(),
        };
        let robustness = |e: &Object<Engine>| volume_view(&v, Some(e), &[]).robustness;
        e.data.status.state = ProcessState::Running;
        assert_eq!(robustness(&e), Robustness::Healthy);
        // Restarted (a new process not serving yet), crashed or stopped: not healthy on the stored word.
        for s in [
            ProcessState::Starting,
            ProcessState::Crashed,
            ProcessState::Stopped,
        ] {
            e.data.status.state = s;
            assert_eq!(robustness(&e), Robustness::Unknown, "{s:?}");
        }
        // No engine (detached): the stored value, which the controller keeps.
        assert_eq!(volume_view(&v, None, &[]).robustness, Robustness::Healthy);
    }
}
