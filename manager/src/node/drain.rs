//! Node drain (`corral node drain NODE`, `POST /v1/nodes/{node}/drain`): the node stops taking replicas, and every
//! replica on it is *evicted*: the volume controller places a replacement on another node first, the engine
//! rebuilds it, and only once the volume has its full count of RW replicas off the node is the evicted one taken
//! out of the engine and then deleted (its node's manager stops it and removes its data). A volume never has fewer
//! replicas than it asks for while this happens.
//!
//! Refused up front (409, nothing written) when it could not finish:
//! - a volume is attached on the node (its engine runs there): drain moves replicas, not engines; detach it or
//!   attach it on another node first;
//! - a volume with a replica there is detached: a replacement is rebuilt through the volume's engine, and there is
//!   none; attach it (on another node) first;
//! - the other nodes' disks cannot take the replacements (room, `replica-soft-anti-affinity`, the volume's data
//!   engine): the message names each volume and why.
//!
//! The node's status shows it: `drainState` draining (with `replicas`, how many are left) or drained, and
//! `drainBlocked`: a volume detached after the drain began keeps its replica on the node (there is no engine to
//! rebuild a replacement through) and is named there until it is attached again. `corral node
//! uncordon` ends a drain (replicas not moved yet stay) and makes the node schedulable again.

use std::collections::{BTreeMap, HashSet};

pub use corral_api::node::DrainState;

use crate::context::Ctx;
use crate::model::{Node, Replica};
use crate::store::Object;

/// Where `node` is in a drain with `replicas_left` replicas still on it.
pub fn drain_state(node: &Node, replicas_left: usize) -> DrainState {
    match (node.spec.drain_requested, replicas_left) {
        (false, _) => DrainState::None,
        (true, 0) => DrainState::Drained,
        (true, _) => DrainState::Draining,
    }
}

/// The names of the nodes being drained.
pub async fn draining_nodes(ctx: &Ctx) -> Result<HashSet<String>, crate::store::StoreError> {
    Ok(ctx
        .db
        .list::<Node>()
        .await?
        .into_iter()
        .filter(|n| n.data.spec.drain_requested)
        .map(|n| n.name)
        .collect())
}

/// What the volume controller does with a volume's replicas while some are evicted.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Replicas the volume keeps (not on a draining node): placement counts these against numberOfReplicas.
    pub staying: usize,
    /// Replica names the engine should serve: every healthy one, until the staying ones are enough RW replicas;
    /// then the evicted ones leave the engine.
    pub engine_replicas: Vec<String>,
    /// Evicted replicas out of the engine already: their documents go.
    pub delete: Vec<String>,
}

/// Decides [`Eviction`] for the healthy (not failed) `replicas` of a volume wanting `want` replicas, given the
/// draining nodes and the replica modes its engine last listed (address → RW | WO | ERR; empty when detached).
pub fn evict(
    replicas: &[Object<Replica>],
    draining: &HashSet<String>,
    modes: &BTreeMap<String, String>,
    want: usize,
) -> Eviction {
    let evicted = |r: &Object<Replica>| draining.contains(&r.data.spec.node_id);
    let staying = replicas.iter().filter(|r| !evicted(r)).count();
    let staying_rw = replicas
        .iter()
        .filter(|r| !evicted(r) && modes.get(&r.data.status.address).is_some_and(|m| m == "RW"))
        .count();
    let mut out = Eviction {
        staying,
        ..Default::default()
    };
    let replaced = want > 0 && staying_rw >= want;
    for r in replicas {
        if !evicted(r) || !replaced {
            out.engine_replicas.push(r.name.clone());
        } else if r.data.status.address.is_empty() || !modes.contains_key(&r.data.status.address) {
            out.delete.push(r.name.clone());
        }
    }
    out.engine_replicas.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ReplicaSpec;

    fn replica(name: &str, node: &str, address: &str) -> Object<Replica> {
        Object {
            name: name.into(),
            version: 1,
            data: Replica {
                spec: ReplicaSpec {
                    node_id: node.into(),
                    ..Default::default()
                },
                status: crate::model::ReplicaStatus {
                    address: address.into(),
                    ..Default::default()
                },
            },
        }
    }

    fn modes(m: &[(&str, &str)]) -> BTreeMap<String, String> {
        m.iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn an_evicted_replica_leaves_the_engine_only_after_its_replacement_is_rw_and_goes_once_out() {
        let draining: HashSet<String> = ["n1".to_owned()].into();
        let rs = vec![
            replica("a", "n0", "A"),
            replica("b", "n1", "B"),
            replica("c", "n2", "C"),
        ];
        // Replacement not placed yet: two stay, the engine keeps all three... of two plus the evicted one.
        let e = evict(&rs[..2], &draining, &modes(&[("A", "RW"), ("B", "RW")]), 2);
        assert_eq!(e.staying, 1);
        assert_eq!(e.engine_replicas, ["a", "b"]);
        assert!(e.delete.is_empty());
        // Replacement rebuilding (WO): the evicted one still serves.
        let e = evict(
            &rs,
            &draining,
            &modes(&[("A", "RW"), ("B", "RW"), ("C", "WO")]),
            2,
        );
        assert_eq!((e.staying, e.engine_replicas.len()), (2, 3));
        assert!(e.delete.is_empty());
        // Replacement RW: the evicted one leaves the engine, its document stays while the engine lists it.
        let e = evict(
            &rs,
            &draining,
            &modes(&[("A", "RW"), ("B", "RW"), ("C", "RW")]),
            2,
        );
        assert_eq!(e.engine_replicas, ["a", "c"]);
        assert!(e.delete.is_empty());
        // Out of the engine: deleted.
        let e = evict(&rs, &draining, &modes(&[("A", "RW"), ("C", "RW")]), 2);
        assert_eq!(e.delete, ["b"]);
    }

    #[test]
    fn without_a_drain_every_healthy_replica_serves() {
        let rs = vec![replica("a", "n0", "A"), replica("b", "n1", "")];
        let e = evict(&rs, &HashSet::new(), &BTreeMap::new(), 2);
        assert_eq!(
            e,
            Eviction {
                staying: 2,
                engine_replicas: vec!["a".into(), "b".into()],
                delete: vec![]
            }
        );
    }
}
