//! The engine generation on gRPC calls to a replica (`docs/formats.md`, "Engine generation"): every caller that
//! changes a replica's data, chain or serving state sends the volume's generation in the metadata key
//! [`METADATA_KEY`] ([`EngineGeneration`], a client interceptor), and a replica checks every call with one tower
//! layer ([`FenceLayer`], shared by the v1 daemon and each replica of the v2 lvstore daemon):
//! - a call carrying a generation below the one the replica accepted is refused, as such an engine's data
//!   connections are;
//! - a call in [`MUTATING`] carrying none (an engine or tool that predates fencing) is refused once the replica has
//!   accepted a generation (> 0), with a message saying to upgrade; a fresh replica (record 0) accepts it;
//! - every other call ([`READS`]: status, lists, and the source side of rebuild, clone and export, which only
//!   read the replica) passes without one.
//!
//! [`NODE_LEVEL`] lists the v2 lvstore daemon's own service: it hosts many replicas of many volumes, and adding or
//! removing one is the manager's decision about where a volume lives (like a v1 replica's process and directory,
//! which the instance manager removes), not an engine's call; it carries no generation.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::http;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Status};

/// gRPC metadata key: the calling engine's generation, decimal ASCII.
pub const METADATA_KEY: &str = "corral-engine-generation";

/// Every call that changes a replica's data, chain, metadata or serving state (gRPC paths). Without a generation,
/// refused by a replica that accepted one.
pub const MUTATING: &[&str] = &[
    "/corral.v1.ReplicaService/ReplicaCreate",
    "/corral.v1.ReplicaService/ReplicaDelete",
    "/corral.v1.ReplicaService/ReplicaOpen",
    "/corral.v1.ReplicaService/ReplicaClose",
    "/corral.v1.ReplicaService/ReplicaReload",
    "/corral.v1.ReplicaService/ReplicaRevert",
    "/corral.v1.ReplicaService/ReplicaSnapshot",
    "/corral.v1.ReplicaService/ReplicaExpand",
    "/corral.v1.ReplicaService/DiskMarkAsRemoved",
    "/corral.v1.ReplicaService/RebuildingSet",
    "/corral.v1.ReplicaService/RevisionCounterSet",
    "/corral.v1.SyncAgentService/SnapshotPurge",
    "/corral.v1.SyncAgentService/FilesSync",
    "/corral.v1.SyncAgentService/SnapshotClone",
    // A completed full backup clears the replica's chain-end marker.
    "/corral.v1.ReplicaBackupService/BackupCreate",
    "/corral.v1.ReplicaBackupService/BackupRestore",
    "/corral.v1.ReplicaBackupService/BackupChainEnd",
];

/// Every call on a replica that changes neither its data nor its chain: passes without a generation (one below
/// the record is still refused). `FileSend`, `VolumeExport` and `LocalFiles` are a rebuild's, export's or clone's
/// source side: they read this replica and write elsewhere (the target's own `FilesSync`/`SnapshotClone` is in
/// [`MUTATING`]). `SnapshotHash` records the checksum the replica itself computes of an immutable snapshot: a
/// caller cannot put anything into it.
pub const READS: &[&str] = &[
    "/corral.v1.ReplicaService/ReplicaGet",
    "/corral.v1.SyncAgentService/SnapshotPurgeStatus",
    "/corral.v1.SyncAgentService/SnapshotHash",
    "/corral.v1.SyncAgentService/SnapshotHashStatus",
    "/corral.v1.SyncAgentService/SnapshotHashCancel",
    "/corral.v1.SyncAgentService/ReplicaRebuildStatus",
    "/corral.v1.SyncAgentService/FileSend",
    "/corral.v1.SyncAgentService/VolumeExport",
    "/corral.v1.SyncAgentService/LocalFiles",
    "/corral.v1.SyncAgentService/SnapshotCloneStatus",
    "/corral.v1.ReplicaBackupService/BackupStatus",
    "/corral.v1.ReplicaBackupService/BackupCancel",
    "/corral.v1.ReplicaBackupService/RestoreStatus",
];

/// The v2 lvstore daemon's own service (see the module doc): not a replica's, not fenced.
pub const NODE_LEVEL: &[&str] = &[
    "/corral.v1.LvstoreService/LvstoreReplicaAdd",
    "/corral.v1.LvstoreService/LvstoreReplicaRemove",
    "/corral.v1.LvstoreService/LvstoreReplicaList",
    "/corral.v1.LvstoreService/LvstoreInfo",
    "/corral.v1.LvstoreService/BackingImageCreate",
    "/corral.v1.LvstoreService/BackingImageDelete",
    "/corral.v1.LvstoreService/BackingImageGet",
    "/corral.v1.LvstoreService/BackingImageList",
    "/corral.v1.LvstoreService/BackingImageWatch",
    "/corral.v1.LvstoreService/BackingImageExpose",
    "/corral.v1.LvstoreService/BackingImageUnexpose",
];

/// Client interceptor: adds the generation to every request (nothing for 0, a caller without one).
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineGeneration(pub u64);

impl tonic::service::Interceptor for EngineGeneration {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if self.0 > 0 {
            req.metadata_mut()
                .insert(METADATA_KEY, MetadataValue::from(self.0));
        }
        Ok(req)
    }
}

/// The generation a request carries (`None`: none); a value that is not a decimal u64 is invalid.
pub fn of_request(meta: &MetadataMap) -> Result<Option<u64>, Status> {
    let Some(v) = meta.get(METADATA_KEY) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            Status::invalid_argument(format!("gRPC metadata {METADATA_KEY}: {v:?} is not a generation"))
        })
}

/// Replica side, for the call to gRPC `path`: refuses (`FAILED_PRECONDITION`) a call carrying a generation below
/// the replica's record (naming both numbers), and a [`MUTATING`] call carrying none once the record is above 0
/// (naming it, saying to upgrade). `recorded` reads the record, only when the answer depends on it; when it
/// cannot be read, such a call is refused with its error (`UNAVAILABLE`): the replica does not guess.
pub fn check_call(
    path: &str,
    meta: &MetadataMap,
    recorded: impl FnOnce() -> Result<u64, String>,
) -> Result<(), Status> {
    let presented = of_request(meta)?;
    if presented.is_none() && !MUTATING.contains(&path) {
        return Ok(());
    }
    let recorded = recorded().map_err(Status::unavailable)?;
    match presented {
        Some(presented) if presented < recorded => Err(Status::failed_precondition(format!(
            "fenced by generation {recorded} > {presented}: the replica has accepted engine generation {recorded}; \
             this engine (generation {presented}) is stale"
        ))),
        None if recorded > 0 => Err(Status::failed_precondition(format!(
            "this replica has accepted engine generation {recorded}; {path} without a generation (from an engine or \
             tool that predates fencing) is refused: upgrade it, or pass the volume's current generation \
             (--generation)"
        ))),
        _ => Ok(()),
    }
}

/// Server layer applying [`check_call`] to every call before its service runs; `R` reads the replica's record.
#[derive(Clone)]
pub struct FenceLayer<R> {
    recorded: R,
}

impl<R> FenceLayer<R>
where
    R: Fn() -> Result<u64, String> + Clone + Send + Sync + 'static,
{
    /// Checks calls against the record `recorded` reads.
    pub fn new(recorded: R) -> Self {
        Self { recorded }
    }
}

impl<S, R: Clone> tower::Layer<S> for FenceLayer<R> {
    type Service = Fence<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Fence {
            inner,
            recorded: self.recorded.clone(),
        }
    }
}

/// The service [`FenceLayer`] wraps around a replica's gRPC services.
#[derive(Clone)]
pub struct Fence<S, R> {
    inner: S,
    recorded: R,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, R, B> tower::Service<http::Request<B>> for Fence<S, R>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Fn() -> Result<u64, String>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let meta = MetadataMap::from_headers(req.headers().clone());
        match check_call(req.uri().path(), &meta, &self.recorded) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                // The operator of a stale engine or tool looks for why in the replica's log.
                tracing::warn!(path = req.uri().path(), error = status.message(), "call refused");
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every `rpc` of every service in the replica-side .proto files, as gRPC paths.
    fn declared_methods() -> BTreeSet<String> {
        let files = [
            include_str!("../proto/corral/v1/replica.proto"),
            include_str!("../proto/corral/v1/syncagent.proto"),
            include_str!("../proto/corral/v1/backup.proto"),
            include_str!("../proto/corral/v1/lvstore.proto"),
        ];
        let mut out = BTreeSet::new();
        for text in files {
            let mut service = None;
            for line in text.lines().map(str::trim) {
                if let Some(rest) = line.strip_prefix("service ") {
                    service = rest.split_whitespace().next().map(str::to_owned);
                } else if let Some(rest) = line.strip_prefix("rpc ") {
                    let name = rest.split('(').next().unwrap_or_default().trim();
                    let s = service.as_deref().expect("rpc outside a service");
                    out.insert(format!("/corral.v1.{s}/{name}"));
                }
            }
        }
        out
    }

    #[test]
    fn every_replica_side_method_is_classified_once() {
        let declared = declared_methods();
        assert!(declared.len() > 30, "parsed too few methods: {declared:?}");
        let mut classified = BTreeSet::new();
        for p in MUTATING.iter().chain(READS).chain(NODE_LEVEL) {
            assert!(classified.insert((*p).to_owned()), "{p} is classified twice");
        }
        let unclassified: Vec<_> = declared.difference(&classified).collect();
        assert!(
            unclassified.is_empty(),
            "new gRPC methods must be listed in MUTATING, READS or NODE_LEVEL \
             (proto/src/engine_generation.rs): {unclassified:?}"
        );
        let stale: Vec<_> = classified.difference(&declared).collect();
        assert!(
            stale.is_empty(),
            "classified methods that no .proto declares: {stale:?}"
        );
    }

    fn meta(generation: Option<u64>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(g) = generation {
            m.insert(METADATA_KEY, MetadataValue::from(g));
        }
        m
    }

    const SNAPSHOT: &str = "/corral.v1.ReplicaService/ReplicaSnapshot";
    const GET: &str = "/corral.v1.ReplicaService/ReplicaGet";

    #[test]
    fn a_mutating_call_without_a_generation_is_refused_once_a_generation_was_accepted() {
        let e = check_call(SNAPSHOT, &meta(None), || Ok(2)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("generation 2"), "{}", e.message());
        assert!(e.message().contains("upgrade"), "{}", e.message());
        check_call(SNAPSHOT, &meta(None), || Ok(0)).unwrap();
        check_call(SNAPSHOT, &meta(Some(2)), || Ok(2)).unwrap();
        check_call(SNAPSHOT, &meta(Some(3)), || Ok(2)).unwrap();
        let e = check_call(SNAPSHOT, &meta(Some(1)), || Ok(2)).unwrap_err();
        assert!(
            e.message().starts_with("fenced by generation 2 > 1"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn a_read_without_a_generation_passes_without_reading_the_record() {
        check_call(GET, &meta(None), || panic!("record read for a read")).unwrap();
        let e = check_call(GET, &meta(Some(1)), || Ok(2)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn an_unreadable_record_refuses_what_depends_on_it() {
        let e = check_call(SNAPSHOT, &meta(None), || Err("corrupt record".into())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        check_call(GET, &meta(None), || Err("corrupt record".into())).unwrap();
    }
}
