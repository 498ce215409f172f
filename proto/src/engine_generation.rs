//! The engine generation on gRPC calls to a replica (`docs/formats.md`, "Engine generation"): an engine sends its
//! generation in the metadata key [`METADATA_KEY`] of every call ([`EngineGeneration`], a client interceptor), and a
//! replica refuses a call whose generation is below the one it accepted ([`check`]), as it refuses such an engine's
//! data connections. A call without the key (the manager, the CLIs, an engine started without `--generation`) is
//! not an engine's claim and passes.

use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Status};

/// gRPC metadata key: the calling engine's generation, decimal ASCII.
pub const METADATA_KEY: &str = "corral-engine-generation";

/// Client interceptor: adds the generation to every request (nothing for 0, an engine without one).
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

/// Replica side: refuses (`FAILED_PRECONDITION`, naming both numbers) a request carrying a generation below
/// `recorded`, the highest the replica accepted. `recorded` is an error when the replica cannot read its record:
/// then a request that carries a generation is refused with it (`UNAVAILABLE`), one without passes.
pub fn check(meta: &MetadataMap, recorded: Result<u64, String>) -> Result<(), Status> {
    let Some(presented) = of_request(meta)? else {
        return Ok(());
    };
    let recorded = recorded.map_err(Status::unavailable)?;
    if presented < recorded {
        return Err(Status::failed_precondition(format!(
            "fenced by generation {recorded} > {presented}: the replica has accepted engine generation {recorded}; \
             this engine (generation {presented}) is stale"
        )));
    }
    Ok(())
}
