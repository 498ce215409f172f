//! What a node's data plane can do, and the rule that keeps a manager newer than a node's data plane from asking
//! it for more. Each node's manager records its data plane's version and features in the node's status at every
//! heartbeat (the instance manager's `VersionGet`, or this manager's own build when it runs the daemons itself);
//! a volume's engine or replica goes only on a node whose data plane has every feature the volume needs. The
//! feature names are `corral_proto::data_plane`'s.

use corral_proto::data_plane as feature;

use crate::model::{DataEngine, Node, Volume};

/// The role a node plays for a volume: what it has to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Engine,
    Replica,
}

/// What a volume asks of the data plane of a node that runs its engine or one of its replicas.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Needs {
    pub engine: DataEngine,
    pub revision_counter_disabled: bool,
    pub backing_image: bool,
}

impl Needs {
    pub fn of(v: &Volume) -> Self {
        Self {
            engine: v.spec.data_engine,
            revision_counter_disabled: v.status.revision_counter_disabled,
            backing_image: v.spec.backing_image.is_some(),
        }
    }

    /// The features `role` needs: the volume's data engine, and the options the manager passes as flags to the
    /// daemons of that role (the engine takes no backing file).
    pub fn features(&self, role: Role) -> Vec<&'static str> {
        let mut out = vec![self.engine.as_str()];
        if self.revision_counter_disabled {
            out.push(feature::DISABLE_REVISION_COUNTER);
        }
        if self.backing_image && role == Role::Replica {
            out.push(feature::BACKING_IMAGE);
        }
        out
    }
}

/// The features of `node`'s data plane (all of them when its manager predates the report).
pub fn features(node: &Node) -> Vec<String> {
    feature::effective(&node.status.data_plane_features)
}

/// Why `node` (named `name`) cannot play `role` for a volume needing `needs`; None when it can.
pub fn lacking(name: &str, node: &Node, needs: &Needs, role: Role) -> Option<String> {
    let have = features(node);
    let missing: Vec<&str> = needs
        .features(role)
        .into_iter()
        .filter(|f| !have.iter().any(|h| h == f))
        .collect();
    if missing.is_empty() {
        return None;
    }
    let version = if node.status.data_plane_version.is_empty() {
        "unknown version"
    } else {
        node.status.data_plane_version.as_str()
    };
    Some(format!(
        "node {name}'s data plane ({version}, features {}) cannot run {} of this volume: it lacks {} (upgrade \
         the node's instance manager first)",
        have.join(","),
        match role {
            Role::Engine => "the engine",
            Role::Replica => "a replica",
        },
        missing.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(version: &str, features: &[&str]) -> Node {
        let mut n = Node::default();
        n.status.data_plane_version = version.into();
        n.status.data_plane_features = features.iter().map(|s| (*s).to_owned()).collect();
        n
    }

    fn needs(engine: DataEngine, rc_off: bool, backing: bool) -> Needs {
        Needs {
            engine,
            revision_counter_disabled: rc_off,
            backing_image: backing,
        }
    }

    #[test]
    fn a_v1_only_data_plane_runs_plain_v1_volumes_and_refuses_what_it_lacks_naming_node_version_feature() {
        let old = node("0.9.0-v1only", &["v1"]);
        assert_eq!(
            lacking("n2", &old, &needs(DataEngine::V1, false, false), Role::Engine),
            None
        );
        assert_eq!(
            lacking("n2", &old, &needs(DataEngine::V1, false, false), Role::Replica),
            None
        );
        let why = lacking("n2", &old, &needs(DataEngine::V1, true, false), Role::Engine).unwrap();
        assert!(
            why.contains("node n2")
                && why.contains("0.9.0-v1only")
                && why.contains("lacks disable-revision-counter"),
            "{why}"
        );
        let why = lacking("n2", &old, &needs(DataEngine::V2, false, true), Role::Replica).unwrap();
        assert!(
            why.contains("lacks v2, backing-image") && why.contains("a replica"),
            "{why}"
        );
    }

    #[test]
    fn the_engine_needs_no_backing_image_support_and_a_node_without_a_report_has_everything() {
        let old = node("0.9.0", &["v1", "disable-revision-counter"]);
        assert_eq!(
            lacking("n", &old, &needs(DataEngine::V1, true, true), Role::Engine),
            None
        );
        assert!(lacking("n", &old, &needs(DataEngine::V1, true, true), Role::Replica).is_some());
        let unreported = node("", &[]);
        assert_eq!(
            lacking(
                "n",
                &unreported,
                &needs(DataEngine::V2, true, true),
                Role::Replica
            ),
            None
        );
    }
}
