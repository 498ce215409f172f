//! The first admin token: made when the store holds no token at all, written to [`super::BOOTSTRAP_FILE`] in the
//! data directory (mode 0600; temp file, fsync, rename, fsync of the directory) so `corral` on the same machine
//! finds it and nobody types anything. A later start finds tokens in the store and makes none (a cluster's other
//! managers do not get the file: copy it, or create a token with `corral token create`). A token already in the
//! file when the store is empty (a Kubernetes Secret mounted there) is adopted rather than replaced.

use std::path::Path;

use anyhow::Context;
pub use corral_api::token::read_token_file;

use super::model::{Role, Token};
use super::{BOOTSTRAP_NAME, service};
use crate::store::{Db, StoreError};

/// Shortest token text adopted from a file (a mounted Secret): 32 characters.
const MIN_ADOPTED_LEN: usize = 32;

/// Makes the admin token when the store has none and writes it to `path`; when `path` already holds a token (a
/// Secret mounted there, or the file of an earlier store), that token is adopted instead. Returns whether a token
/// was made.
pub async fn ensure_admin_token(db: &Db, path: &Path) -> anyhow::Result<bool> {
    if !db.list::<Token>().await?.is_empty() {
        return Ok(false);
    }
    let adopted = match read_token_file(path) {
        Ok(t) => {
            anyhow::ensure!(
                t.len() >= MIN_ADOPTED_LEN,
                "the admin token in {} is {} characters: at least {MIN_ADOPTED_LEN} random ones are needed",
                path.display(),
                t.len()
            );
            Some(t)
        }
        Err(_) if !path.exists() => None,
        Err(e) => return Err(e),
    };
    let made = match &adopted {
        Some(secret) => service::adopt(db, BOOTSTRAP_NAME, Role::Admin, secret).await,
        None => service::create(db, BOOTSTRAP_NAME, Role::Admin).await,
    };
    let (obj, secret) = match made {
        Ok(created) => created,
        // Another manager of the cluster made it first.
        Err(service::TokenError::Store(StoreError::AlreadyExists { .. })) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    if adopted.is_some() {
        tracing::info!(token = obj.name, file = %path.display(), "adopted the admin token in the file");
        return Ok(true);
    }
    if let Err(e) = write_secret_file(path, &secret) {
        // A token nobody can read is useless: take it back so the next start makes one again.
        let _ = service::revoke(db, &obj.name).await;
        return Err(e);
    }
    tracing::info!(token = obj.name, file = %path.display(), "made the first admin token");
    Ok(true)
}

/// Writes `secret` to `path` with mode 0600, atomically: a reader sees the old file or the whole new one.
pub fn write_secret_file(path: &Path, secret: &str) -> anyhow::Result<()> {
    corral_disk::durable::write_atomic_mode(path, format!("{secret}\n").as_bytes(), 0o600)
        .with_context(|| format!("write {}", path.display()))
}
