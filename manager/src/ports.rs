//! Ports of this node's daemons: which ones the store says are held (running or not), and new ones from the
//! node's range. One place for every kind of daemon (replica, engine, `corral-bim`, `corral-datasource`), so
//! no two are handed the same port; it sits above `context` and the resource modules so neither depends on
//! the other for it.

use std::collections::BTreeSet;

use crate::backing_image::model::{BackingImageDataSource, BackingImageManager};
use crate::context::Ctx;
use crate::model::{Engine, Replica};
use crate::process::{ProcessError, allocate_ports};

/// Ports a `corral-bim` takes: gRPC, HTTP, then its sync receivers' range.
pub const BIM_PORTS: u16 = 12;

/// Ports held by daemons of this node that the store knows about (running or not).
pub async fn reserved(ctx: &Ctx) -> BTreeSet<u16> {
    let node = ctx.cfg.node_id.as_str();
    let mut out = BTreeSet::new();
    if let Ok(rs) = ctx.db.list::<Replica>().await {
        for p in rs
            .iter()
            .filter(|r| r.data.spec.node_id == node)
            .filter_map(|r| r.data.status.process.as_ref())
        {
            out.extend(p.port..p.port.saturating_add(3));
        }
    }
    if let Ok(es) = ctx.db.list::<Engine>().await {
        for p in es
            .iter()
            .filter(|e| e.data.spec.node_id == node)
            .filter_map(|e| e.data.status.process.as_ref())
        {
            out.extend(p.port..p.port.saturating_add(3));
        }
    }
    if let Ok(ms) = ctx.db.list::<BackingImageManager>().await {
        for p in ms
            .iter()
            .filter(|m| m.data.spec.node_id == node)
            .filter_map(|m| m.data.status.process.as_ref())
        {
            out.extend(p.port..p.port.saturating_add(BIM_PORTS));
        }
    }
    if let Ok(ds) = ctx.db.list::<BackingImageDataSource>().await {
        for p in ds
            .iter()
            .filter(|d| d.data.spec.node_id == node)
            .filter_map(|d| d.data.status.process.as_ref())
        {
            out.insert(p.port);
        }
    }
    out
}

/// `width` free ports of the node's range that no known daemon holds.
pub async fn allocate(ctx: &Ctx, width: u16) -> Result<u16, ProcessError> {
    let held = reserved(ctx).await;
    allocate_ports(&ctx.cfg.host, ctx.cfg.port_range, width, &held)
}

/// Three consecutive ports for a replica or engine: its previous ones when still free (clients keep their
/// address), otherwise new ones from the node's range.
pub async fn daemon_ports(ctx: &Ctx, previous: Option<u16>) -> Result<u16, ProcessError> {
    let host = ctx.cfg.host.as_str();
    if let Some(p) = previous.filter(|p| *p != 0)
        && (p..p.saturating_add(3)).all(|q| std::net::TcpListener::bind((host, q)).is_ok())
    {
        return Ok(p);
    }
    allocate(ctx, 3).await
}
