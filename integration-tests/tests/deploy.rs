//! The Kubernetes manifests in `deploy/` render with `kubectl kustomize` and every object passes strict schema
//! validation offline (`deploy/validate.sh`, which installs kubectl and kubernetes-validate when missing). Skipped,
//! with the reason printed, when the tools are missing and cannot be installed (not root).

use std::path::Path;
use std::process::Command;

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn kustomize_renders_deploy_and_every_object_passes_schema_validation() {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root && (!have("kubectl") || !have("kubernetes-validate")) {
        eprintln!(
            "SKIPPED deploy validation: kubectl or kubernetes-validate missing and not root to install them"
        );
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/validate.sh");
    let out = Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "deploy/validate.sh failed:\n{text}");
    assert!(text.contains("objects rendered"), "{text}");
    assert!(!text.contains("failed validation"), "{text}");
    eprintln!("{}", text.lines().next().unwrap_or_default());
}
