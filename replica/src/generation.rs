//! The highest engine generation this replica directory has accepted: `engine.generation`, JSON
//! `{"generation": N}`, written crash-safely (temp file, fsync, rename, fsync of the directory) before the
//! data-protocol `Hello` that raised it is answered. No file: no generation yet (0). A file that does not parse
//! is corrupt: the replica then refuses every data connection rather than guess a number (see
//! `docs/formats.md` for the recovery).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::meta::{load_json, write_json_atomic};
use crate::names::ENGINE_GENERATION;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationRecord {
    generation: u64,
}

/// The generation recorded in `dir` (0 when there is no record).
pub fn load(dir: &Path) -> Result<u64> {
    Ok(load_json::<GenerationRecord>(&dir.join(ENGINE_GENERATION))?.map_or(0, |r| r.generation))
}

/// Records `generation` in `dir`, durable when this returns.
pub fn store(dir: &Path, generation: u64) -> Result<()> {
    write_json_atomic(dir, ENGINE_GENERATION, &GenerationRecord { generation })
}
