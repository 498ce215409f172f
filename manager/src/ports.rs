//! Ports of this node's replicas while the engine still derives a replica's data and sync ports from its control
//! port (+1, +2): three consecutive ports from the node's range that no recorded daemon of this node holds.
//! Every other daemon is started on port 0 and reports what it bound (`process`).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};

use crate::backing_image::model::{BackingImageDataSource, BackingImageManager};
use crate::context::Ctx;
use crate::model::{Engine, ProcessRecord, Replica};

/// Why no ports could be handed out.
#[derive(Debug, thiserror::Error)]
#[error("no 3 free consecutive ports in {from}..{to} on {host}")]
pub struct NoPorts {
    host: String,
    from: u16,
    to: u16,
}

fn held(rec: &ProcessRecord, out: &mut BTreeSet<u16>) {
    out.extend(
        rec.listen
            .values()
            .filter_map(|a| a.parse::<SocketAddr>().ok())
            .map(|a| a.port()),
    );
}

/// Ports the listeners of this node's recorded daemons reported (running or not).
async fn reserved(ctx: &Ctx) -> BTreeSet<u16> {
    let node = ctx.cfg.node_id.as_str();
    let mut out = BTreeSet::new();
    if let Ok(rs) = ctx.db.list::<Replica>().await {
        for r in rs.iter().filter(|r| r.data.spec.node_id == node) {
            if let Some(p) = &r.data.status.process {
                held(p, &mut out);
            }
        }
    }
    if let Ok(es) = ctx.db.list::<Engine>().await {
        for e in es.iter().filter(|e| e.data.spec.node_id == node) {
            if let Some(p) = &e.data.status.process {
                held(p, &mut out);
            }
        }
    }
    if let Ok(ms) = ctx.db.list::<BackingImageManager>().await {
        for m in ms.iter().filter(|m| m.data.spec.node_id == node) {
            if let Some(p) = &m.data.status.process {
                held(p, &mut out);
            }
        }
    }
    if let Ok(ds) = ctx.db.list::<BackingImageDataSource>().await {
        for d in ds.iter().filter(|d| d.data.spec.node_id == node) {
            if let Some(p) = &d.data.status.process {
                held(p, &mut out);
            }
        }
    }
    out
}

/// Three consecutive ports for a replica: its previous ones when still free (the engine keeps its address),
/// otherwise new ones from the node's range.
pub async fn replica_ports(ctx: &Ctx, previous: Option<u16>) -> Result<u16, NoPorts> {
    let host = ctx.cfg.host.as_str();
    let free = |p: u16| TcpListener::bind((host, p)).is_ok();
    if let Some(p) = previous.filter(|p| *p != 0)
        && (p..p.saturating_add(3)).all(free)
    {
        return Ok(p);
    }
    let reserved = reserved(ctx).await;
    let (from, to) = ctx.cfg.port_range;
    let mut p = from;
    while p.saturating_add(3) <= to {
        if (p..p + 3).all(|q| !reserved.contains(&q) && free(q)) {
            return Ok(p);
        }
        p += 3;
    }
    Err(NoPorts {
        host: host.to_owned(),
        from,
        to,
    })
}
