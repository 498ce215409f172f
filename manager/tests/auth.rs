//! The REST API's bearer tokens against a real `corral-manager` over real HTTP: no token, a garbage or malformed
//! one, a revoked one, a viewer's write and an operator's setting or token change are refused with the documented
//! JSON errors (401 / 403) and change nothing; a token in the query string and an oversized Authorization header
//! are refused; health and metrics stay open. The first admin token is in the data directory with mode 0600, the
//! CLI finds it there (`CORRAL_DATA_DIR`), in `CORRAL_TOKEN` or in `--token-file`, and no token's text ever
//! reaches the manager's log.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use serde_json::{Value, json};
use support::*;

/// `curl` with `args` (headers, method, URL): (status, body as JSON, or Null).
fn curl(args: &[&str]) -> (u16, Value) {
    let out = Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        code.trim().parse().unwrap_or(0),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

/// A refusal as the API documents it: the status and `{code, message}` with a message.
fn assert_refused(got: &(u16, Value), status: u16, code: &str, what: &str) {
    assert_eq!(got.0, status, "{what}: {}", got.1);
    assert_eq!(got.1["code"], json!(code), "{what}: {}", got.1);
    assert!(
        got.1["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {}",
        got.1
    );
}

fn volume_names(m: &Manager) -> Vec<String> {
    let (code, v) = rest("GET", &format!("{}/v1/volumes", m.url), None);
    assert_eq!(code, 200, "{v}");
    let mut names: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

fn create_token(m: &Manager, name: &str, role: &str) -> String {
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/tokens", m.url),
        Some(&json!({"name": name, "role": role})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["role"], json!(role), "{v}");
    v["token"].as_str().unwrap().to_owned()
}

#[test]
fn requests_without_a_valid_token_or_role_are_refused_as_json_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let admin = admin_token().expect("the manager wrote its admin token");
    let file = m.data_dir.join(manager::token::BOOTSTRAP_FILE);
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{} has mode {mode:o}", file.display());

    let vols = format!("{}/v1/volumes", m.url);
    let (code, v) = rest(
        "POST",
        &vols,
        Some(&json!({"name": "keep", "size": 1 << 20, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "{v}");
    let before = volume_names(&m);
    assert_eq!(before, ["keep"]);
    let keep = format!("{vols}/keep");

    // No token, a garbage one, a malformed header: 401, on reads and on a delete, and nothing is deleted.
    assert_refused(
        &rest_as(None, "GET", &vols, None),
        401,
        "unauthorized",
        "no token",
    );
    assert_refused(
        &rest_as(None, "DELETE", &keep, None),
        401,
        "unauthorized",
        "no token, DELETE",
    );
    let garbage = "corral_0000000000000000000000000000000000000000000000000000000000000000";
    assert_refused(
        &rest_as(Some(garbage), "DELETE", &keep, None),
        401,
        "unauthorized",
        "garbage token",
    );
    let basic = format!("authorization: Basic {admin}");
    assert_refused(
        &curl(&["-H", &basic, "-X", "DELETE", &keep]),
        401,
        "unauthorized",
        "not Bearer",
    );
    assert_refused(
        &curl(&["-H", "authorization: Bearer ", &vols]),
        401,
        "unauthorized",
        "empty Bearer",
    );
    assert_eq!(volume_names(&m), before, "a refused DELETE deleted");

    // A viewer reads and may not write; an operator manages volumes but not settings or tokens.
    let viewer = create_token(&m, "ci-viewer", "viewer");
    let operator = create_token(&m, "ci-operator", "operator");
    assert_eq!(rest_as(Some(&viewer), "GET", &keep, None).0, 200);
    assert_refused(
        &rest_as(Some(&viewer), "DELETE", &keep, None),
        403,
        "forbidden",
        "viewer DELETE",
    );
    assert_refused(
        &rest_as(
            Some(&viewer),
            "POST",
            &vols,
            Some(&json!({"name": "nope", "size": 1 << 20})),
        ),
        403,
        "forbidden",
        "viewer POST",
    );
    assert_eq!(
        volume_names(&m),
        before,
        "a viewer's refused writes changed the volumes"
    );
    let setting = format!("{}/v1/settings/default-replica-count", m.url);
    let (_, was) = rest("GET", &setting, None);
    assert_refused(
        &rest_as(Some(&operator), "PUT", &setting, Some(&json!({"value": "1"}))),
        403,
        "forbidden",
        "operator PUT setting",
    );
    assert_eq!(
        rest("GET", &setting, None).1,
        was,
        "a refused PUT changed the setting"
    );
    let tokens = format!("{}/v1/tokens", m.url);
    assert_refused(
        &rest_as(
            Some(&operator),
            "POST",
            &tokens,
            Some(&json!({"name": "mine", "role": "admin"})),
        ),
        403,
        "forbidden",
        "operator creates a token",
    );
    assert_refused(
        &rest_as(Some(&operator), "GET", &tokens, None),
        403,
        "forbidden",
        "operator lists tokens",
    );
    let (code, v) = rest_as(
        Some(&operator),
        "POST",
        &vols,
        Some(&json!({"name": "op1", "size": 1 << 20, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "an operator creates volumes: {v}");

    // The list shows names and roles, never a secret or its digest.
    let (code, listed) = rest("GET", &tokens, None);
    assert_eq!(code, 200, "{listed}");
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["admin", "ci-operator", "ci-viewer"], "{listed}");
    for secret in [&admin, &viewer, &operator] {
        assert!(!listed.to_string().contains(secret.as_str()), "{listed}");
    }
    assert!(
        listed[0].get("sha256").is_none() && listed[0].get("token").is_none(),
        "{listed}"
    );

    // Revoked: refused from the next request on (through the CLI, as an admin does it).
    let (ok, _, err) = corral(&m.url, &["token", "revoke", "ci-viewer"]);
    assert!(ok, "{err}");
    assert_refused(
        &rest_as(Some(&viewer), "GET", &vols, None),
        401,
        "unauthorized",
        "revoked token",
    );

    // A token in the query string is refused even beside a valid header; an oversized header gets 431.
    let bearer = format!("authorization: Bearer {admin}");
    assert_refused(
        &curl(&["-H", &bearer, &format!("{vols}?token={admin}")]),
        400,
        "invalid",
        "token in the query",
    );
    let huge = format!("authorization: Bearer {}", "a".repeat(5000));
    assert_refused(
        &curl(&["-H", &huge, &vols]),
        431,
        "header-too-large",
        "5000-byte header",
    );

    // Health and metrics need nothing.
    for open in ["/healthz", "/metrics"] {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                &format!("{}{open}", m.url),
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200", "{open}");
    }

    // Refusals are logged with the token's name; no token's text is ever in the log.
    let log = m.log();
    assert!(
        log.lines()
            .any(|l| l.contains("request refused") && l.contains("ci-operator")),
        "no refusal logged with the token's name:\n{log}"
    );
    for (name, secret) in [("admin", &admin), ("viewer", &viewer), ("operator", &operator)] {
        assert!(
            !log.contains(secret.as_str()),
            "the {name} token's text is in the manager's log"
        );
    }
}

#[test]
fn the_cli_finds_its_token_in_the_data_dir_the_environment_or_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let cli = |envs: &[(&str, &std::ffi::OsStr)], args: &[&str]| {
        let out = Command::new(cli_bin())
            .env_remove("CORRAL_TOKEN")
            .env_remove("CORRAL_TOKEN_FILE")
            .env("CORRAL_DATA_DIR", dir.path().join("nowhere"))
            .envs(envs.iter().copied())
            .args(["--url", &m.url, "volume", "ls"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = cli(&[], &[]);
    assert!(!ok && err.contains("401"), "without a token: {err}");
    let (ok, err) = cli(&[("CORRAL_DATA_DIR", m.data_dir.as_os_str())], &[]);
    assert!(ok, "the data directory's admin.token: {err}");
    let token = admin_token().unwrap();
    let (ok, err) = cli(&[("CORRAL_TOKEN", std::ffi::OsStr::new(&token))], &[]);
    assert!(ok, "CORRAL_TOKEN: {err}");
    let file = dir.path().join("my-token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let (ok, err) = cli(&[], &["--token-file", file.to_str().unwrap()]);
    assert!(ok, "--token-file: {err}");
    let (ok, err) = cli(&[("CORRAL_TOKEN", std::ffi::OsStr::new("corral_garbage"))], &[]);
    assert!(
        !ok && err.contains("unknown or revoked"),
        "a garbage CORRAL_TOKEN: {err}"
    );

    // `corral token create` shows the secret once; it then works, and `token list` never shows it.
    let (ok, out, err) = corral(&m.url, &["token", "create", "reader", "--role", "viewer"]);
    assert!(ok, "{err}");
    let secret = out.trim().to_owned();
    assert!(secret.starts_with("corral_") && secret.len() == 71, "{out}");
    let (ok, err) = cli(&[("CORRAL_TOKEN", std::ffi::OsStr::new(&secret))], &[]);
    assert!(ok, "the created token: {err}");
    let (ok, out, err) = corral(&m.url, &["token", "list"]);
    assert!(
        ok && out.contains("reader") && out.contains("viewer"),
        "{out}{err}"
    );
    assert!(!out.contains(&secret) && !out.contains(&token), "{out}");
}

#[test]
fn the_openapi_document_declares_the_bearer_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let (code, doc) = rest("GET", &format!("{}/v1/openapi.json", m.url), None);
    assert_eq!(code, 200, "{doc}");
    let scheme = &doc["components"]["securitySchemes"]["bearer"];
    assert_eq!(
        (&scheme["type"], &scheme["scheme"]),
        (&json!("http"), &json!("bearer")),
        "{scheme}"
    );
    assert_eq!(doc["security"], json!([{"bearer": []}]));
    assert_eq!(doc["paths"]["/healthz"]["get"]["security"], json!([]));
    assert!(doc["paths"]["/v1/volumes"]["get"].get("security").is_none());
    for status in ["401", "403"] {
        assert!(
            doc["paths"]["/v1/volumes/{volume}"]["delete"]["responses"]
                .get(status)
                .is_some(),
            "{status} undocumented"
        );
    }
}
