//! Creating, listing, revoking and checking tokens: the one place that makes a secret and the one that compares
//! one. The secret's text is returned once by [`create`] and never stored, logged or shown again.

use std::io::Read;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::model::{Role, Token};
use crate::store::{Db, Object, StoreError};

/// The prefix of every token's text (lets secret scanners and people recognise one).
pub const PREFIX: &str = "corral_";
/// Random bytes in a token.
const SECRET_BYTES: usize = 32;
/// How stale `lastUsed` may get before a request writes it again (one store write per token per minute at most).
const LAST_USED_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The OS random number generator could not be read.
    #[error("read the OS random number generator: {0}")]
    Rng(std::io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A new token's text: [`PREFIX`] and 32 bytes from the OS RNG in hex.
fn new_secret() -> Result<String, TokenError> {
    let mut bytes = [0u8; SECRET_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(TokenError::Rng)?;
    Ok(format!("{PREFIX}{}", hex::encode(bytes)))
}

/// The stored form of a token's text.
pub fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Equal in time that does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Creates token `name` with `role`; returns it with its text (the only time the text exists outside the caller).
pub async fn create(db: &Db, name: &str, role: Role) -> Result<(Object<Token>, String), TokenError> {
    adopt(db, name, role, &new_secret()?).await
}

/// Stores `secret` (made elsewhere: a mounted Secret the manager adopts) as token `name` with `role`.
pub async fn adopt(
    db: &Db,
    name: &str,
    role: Role,
    secret: &str,
) -> Result<(Object<Token>, String), TokenError> {
    let token = Token {
        role,
        sha256: hex::encode(digest(secret)),
        created: chrono::Utc::now().to_rfc3339(),
        last_used: String::new(),
    };
    let obj = db.create(name, token).await?;
    Ok((obj, secret.to_owned()))
}

pub async fn list(db: &Db) -> Result<Vec<Object<Token>>, StoreError> {
    db.list::<Token>().await
}

/// Deletes token `name`: requests presenting it are refused from now on.
pub async fn revoke(db: &Db, name: &str) -> Result<(), StoreError> {
    db.delete_any::<Token>(name).await
}

/// The stored token whose text is `secret`, if any. Every stored digest is compared (in constant time), so the
/// time taken does not tell how close a guess came.
pub async fn authenticate(db: &Db, secret: &str) -> Result<Option<Object<Token>>, StoreError> {
    let presented = digest(secret);
    let mut found = None;
    for t in db.list::<Token>().await? {
        let stored = hex::decode(&t.data.sha256).unwrap_or_default();
        if constant_time_eq(&stored, &presented) && found.is_none() {
            found = Some(t);
        }
    }
    if let Some(t) = &found {
        touch(db, t);
    }
    Ok(found)
}

/// Records that `t` was used now, in the background, when its `lastUsed` is older than [`LAST_USED_EVERY`].
fn touch(db: &Db, t: &Object<Token>) {
    let now = chrono::Utc::now();
    let fresh = chrono::DateTime::parse_from_rfc3339(&t.data.last_used).is_ok_and(|at| {
        now.signed_duration_since(at)
            .to_std()
            .is_ok_and(|age| age < LAST_USED_EVERY)
    });
    if fresh {
        return;
    }
    let mut t = t.clone();
    let db = db.clone();
    tokio::spawn(async move {
        t.data.last_used = now.to_rfc3339();
        // A conflict means another request (or a revoke) wrote it meanwhile: nothing to do.
        if let Err(e) = db.update(&mut t).await
            && !matches!(e, StoreError::Conflict { .. } | StoreError::NotFound { .. })
        {
            tracing::debug!(token = t.name, error = %e, "could not record the token's last use");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_random_and_distinct() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), PREFIX.len() + 2 * SECRET_BYTES);
        assert!(a.starts_with(PREFIX));
    }

    #[test]
    fn digests_compare_equal_only_when_equal() {
        assert!(constant_time_eq(&digest("x"), &digest("x")));
        assert!(!constant_time_eq(&digest("x"), &digest("y")));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }
}
