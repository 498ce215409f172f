//! The token a client presents (`Authorization: Bearer`), read from a file.

use std::path::Path;

use anyhow::Context;

/// The token in a file (the manager's bootstrap token file, one written by hand, or a mounted Secret): its text,
/// trimmed.
pub fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("read token file {}", path.display()))?;
    let token = text.trim();
    anyhow::ensure!(!token.is_empty(), "token file {} is empty", path.display());
    Ok(token.to_owned())
}
