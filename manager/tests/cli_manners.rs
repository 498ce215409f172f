//! How the `corral` CLI behaves as a Unix citizen: output into a pipe whose reader went away ends it quietly.

mod support;

use std::process::{Command, Stdio};

use serde_json::json;
use support::*;

/// Runs `corral` with stdout into a pipe whose read end is already closed: its first write meets EPIPE.
fn corral_into_closed_pipe(url: &str, args: &[&str]) -> std::process::Output {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    cli_command()
        .args(["--url", url])
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("corral")
}

#[test]
fn output_into_a_closed_pipe_ends_the_cli_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    // Enough volumes that `volume ls --json` is larger than a pipe's buffer (64 KiB): `head -1` exits while the
    // CLI still writes.
    for i in 0..200 {
        let (code, v) = rest(
            "POST",
            &format!("{}/v1/volumes", m.url),
            Some(&json!({"name": format!("pipe{i:03}"), "size": 1 << 20, "numberOfReplicas": 1})),
        );
        assert_eq!(code, 201, "{v}");
    }
    let (ok, all, err) = corral(&m.url, &["volume", "ls", "--json"]);
    assert!(ok && all.len() > 64 << 10, "{} bytes; {err}", all.len());

    for args in [
        &["volume", "get", "pipe000"][..],
        &["volume", "get", "pipe000", "--json"],
        &["volume", "ls"],
        &["node", "ls"],
        &["setting", "ls", "--json"],
        &["--help"],
    ] {
        let out = corral_into_closed_pipe(&m.url, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "corral {args:?} into a closed pipe: {:?}, stderr {stderr:?}",
            out.status
        );
    }

    // The shell pipeline a user types; pipefail makes the CLI's own status count.
    let script = format!(
        "'{}' --url '{}' volume ls --json | head -1",
        cli_bin().display(),
        m.url
    );
    let out = Command::new("bash")
        .args(["-o", "pipefail", "-c", &script])
        .env("CORRAL_TOKEN", admin_token().unwrap())
        .output()
        .expect("bash");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "{:?}, stderr {stderr:?}",
        out.status
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[\n");
}
