//! The conventions every Corral binary follows, in one place so the daemons behave alike: the shared flags and the
//! logging they set up ([`cli`]: `--log-format`, `--log-level`, `--ready-file`), what CLIs print ([`output`]: tables,
//! `--json`, quiet on a closed pipe), the metrics and health server ([`metrics`]), SIGTERM/SIGINT turned into a
//! cancellation, byte sizes with binary suffixes on the command line, progress bars only when a human is watching,
//! freed heap given back to the kernel ([`heap`]), the ready report a daemon gives once its listeners are bound
//! ([`ready`]), how a supervisor starts, recognises and stops a daemon that outlives it ([`supervise`]), and the
//! private unix sockets a daemon serves ([`unix`]). A disk directory's identity and durable writes are
//! `corral_disk`'s.

pub mod cli;
pub mod heap;
pub mod metrics;
pub mod output;
pub mod ready;
pub mod supervise;
pub mod unix;

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT (the daemons' clean-shutdown trigger).
pub fn shutdown_on_signal() -> CancellationToken {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            },
            Err(e) => {
                tracing::error!(error = %e, "cannot install the SIGTERM handler; only SIGINT stops cleanly");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        c.cancel();
    });
    cancel
}

/// Parses `k=v` labels (the `--label` flags of every CLI) into any map: the first `=` splits key from value.
pub fn parse_labels<C: FromIterator<(String, String)>>(labels: &[String]) -> Result<C, String> {
    labels
        .iter()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("label {l:?}: expected k=v"))
        })
        .collect()
}

/// Parses a byte size: a number, optionally with a binary suffix `K`, `M`, `G`, `T` (also `KiB`, `KB`, ... and `B`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number with an optional K/M/G/T suffix"))?;
    if unit.starts_with(['.', ',']) {
        return Err(format!(
            "{s:?}: whole numbers only, with an optional K/M/G/T suffix (1536M rather than 1.5G)"
        ));
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use K, M, G or T, or KiB/MiB/GiB/TiB)"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?}: too large"))
}

/// Renders a byte count for humans (`10 GiB`, `512 KiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024 * 10 && u + 1 < UNITS.len() {
        v /= 1024;
        u += 1;
    }
    format!("{v} {}", UNITS[u])
}

/// A percent progress bar on stderr when it is a terminal, hidden otherwise (scripts and logs stay clean).
pub fn percent_bar(message: &str) -> ProgressBar {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = ProgressBar::new(100);
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}% {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(message.to_owned());
        b.enable_steady_tick(Duration::from_millis(200));
        b
    } else {
        ProgressBar::hidden()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_split_at_the_first_equals_sign_and_a_label_without_one_is_refused() {
        let m: std::collections::BTreeMap<String, String> =
            parse_labels(&["a=1".to_owned(), "b=x=y".to_owned()]).unwrap();
        assert_eq!(m["a"], "1");
        assert_eq!(m["b"], "x=y");
        let e = parse_labels::<Vec<(String, String)>>(&["nokey".to_owned()]).unwrap_err();
        assert_eq!(e, "label \"nokey\": expected k=v");
    }

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_garbage() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert!(parse_size("10X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T").is_err());
        // A fraction is named as such, not as a unit ".5x".
        let e = parse_size("1.5X").unwrap_err();
        assert!(e.contains("whole numbers only"), "{e}");
        let e = parse_size("10X").unwrap_err();
        assert!(
            e.contains("unknown unit \"x\"") && e.contains("use K, M, G or T"),
            "{e}"
        );
    }

    #[test]
    fn human_bytes_picks_a_readable_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(10 << 30), "10 GiB");
    }
}
