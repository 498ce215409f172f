//! What the CLIs print on stdout: tables for people, JSON for scripts (`--json`), written so that a reader that
//! went away (`corral volume ls | head -1`: EPIPE) ends the command quietly with status 0, like any Unix filter.
//!
//! Every record or list a CLI prints goes through [`print()`] (pretty JSON or the human form) or [`print_json_line`]
//! (one compact JSON object per line, for streams of events); tables come from [`table`] and [`field_table`] so
//! every command draws them alike.

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

/// `--json`: the flag of every CLI that prints records (global: before or after the subcommand).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct OutputArgs {
    /// Print JSON instead of tables (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
}

/// Writes `text` and a newline to stdout. EPIPE (the reader is gone) exits with status 0; any other write error
/// exits with status 1 and a message on stderr. `println!` would panic on either.
///
/// The signal is left ignored (as Rust sets it) rather than reset to SIGPIPE's default: that would also kill a
/// daemon run by the same binary (`corral up`) when a socket or its log pipe closes.
pub fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_all(text.as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("{}: cannot write to stdout: {e}", program_name());
            std::process::exit(1);
        }
    }
}

fn program_name() -> String {
    std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "corral".to_owned())
}

/// Prints `v` as pretty JSON with `json`, else the text `human` renders.
///
/// # Errors
/// When `v` cannot be serialized.
pub fn print<T: Serialize + ?Sized>(
    json: bool,
    v: &T,
    human: impl FnOnce() -> String,
) -> Result<(), serde_json::Error> {
    if json {
        emit(&serde_json::to_string_pretty(v)?);
    } else {
        emit(&human());
    }
    Ok(())
}

/// Prints `v` as one compact JSON line (an event of a stream, a summary for a script to parse).
///
/// # Errors
/// When `v` cannot be serialized.
pub fn print_json_line<T: Serialize + ?Sized>(v: &T) -> Result<(), serde_json::Error> {
    emit(&serde_json::to_string(v)?);
    Ok(())
}

/// A table with a header row and one row per record.
pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(header.to_vec());
    for r in rows {
        t.add_row(r);
    }
    t
}

/// A two-column table of one record: field name, value.
pub fn field_table<'a>(fields: impl IntoIterator<Item = (&'a str, String)>) -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    for (k, v) in fields {
        t.add_row(vec![k.to_owned(), v]);
    }
    t
}

/// The serialized name of a unit enum variant (`VolumeState::Attached` → `attached`): how the API spells states.
pub fn serialized_name<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_hold_header_and_rows() {
        let t = table(
            &["NAME", "SIZE"],
            vec![vec!["a".into(), "1 KiB".into()], vec!["b".into(), "2 KiB".into()]],
        )
        .to_string();
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines.iter().any(|l| l.contains("NAME") && l.contains("SIZE")),
            "{t}"
        );
        assert!(
            lines.iter().any(|l| l.contains('b') && l.contains("2 KiB")),
            "{t}"
        );
        let f = field_table([("state", "open".to_owned())]).to_string();
        assert!(f.contains("state") && f.contains("open"), "{f}");
    }

    #[test]
    fn serialized_names_are_the_api_spelling() {
        #[derive(Serialize)]
        #[serde(rename_all = "kebab-case")]
        enum S {
            InProgress,
        }
        assert_eq!(serialized_name(&S::InProgress), "in-progress");
        assert_eq!(serialized_name(&3), "3");
    }
}
