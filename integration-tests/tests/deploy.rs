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

/// The manifests' files, as `deploy/kustomization.yaml` lists them under `resources:`.
fn kustomization_resources(deploy: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(deploy.join("kustomization.yaml")).expect("read kustomization.yaml");
    let mut in_resources = false;
    let mut files = Vec::new();
    for line in text.lines() {
        if !line.starts_with(' ') && !line.starts_with('-') {
            in_resources = line.starts_with("resources:");
        } else if in_resources && let Some(f) = line.trim().strip_prefix("- ") {
            files.push(f.trim().to_owned());
        }
    }
    files
}

/// `name -> newTag` of the kustomization's `images:` list.
fn kustomization_tags(deploy: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy.join("kustomization.yaml")).expect("read kustomization.yaml");
    let mut tags = Vec::new();
    let mut name = None;
    for line in text.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("- name:") {
            name = Some(n.trim().to_owned());
        } else if let (Some(t), Some(n)) = (line.strip_prefix("newTag:"), name.take()) {
            tags.push((n, t.trim().trim_matches('"').to_owned()));
        }
    }
    tags
}

/// Works without kubectl: every `image:` of the kustomization's files (with the tag kustomize gives it) is either a
/// Corral image `docker/build.sh` builds (a `docker/<image>/Dockerfile`), tagged with the workspace version as
/// build.sh tags it, or an external image listed with the same version in `deploy/external-images.txt`; and every
/// listed external image is used.
#[test]
fn every_image_the_manifests_name_is_built_by_build_sh_or_listed_external() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let deploy = root.join("deploy");
    let version = std::fs::read_to_string(root.join("Cargo.toml"))
        .expect("read Cargo.toml")
        .lines()
        .find_map(|l| {
            l.strip_prefix("version = ")
                .map(|v| v.trim().trim_matches('"').to_owned())
        })
        .expect("[workspace.package] version in Cargo.toml");
    let external: Vec<String> = std::fs::read_to_string(deploy.join("external-images.txt"))
        .expect("read deploy/external-images.txt")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    let tags = kustomization_tags(&deploy);
    let mut used_external = Vec::new();
    let mut problems = Vec::new();
    let mut corral_images = Vec::new();
    for file in kustomization_resources(&deploy) {
        let text =
            std::fs::read_to_string(deploy.join(&file)).unwrap_or_else(|e| panic!("read deploy/{file}: {e}"));
        for image in text
            .lines()
            .filter_map(|l| l.trim().trim_start_matches("- ").strip_prefix("image:"))
            .map(|i| i.trim().trim_matches('"').to_owned())
        {
            if external.contains(&image) {
                used_external.push(image);
                continue;
            }
            let (name, tag) = match image.rsplit_once(':') {
                Some((n, t)) => (n.to_owned(), Some(t.to_owned())),
                None => (image.clone(), None),
            };
            let tag = tag.or_else(|| tags.iter().find(|(n, _)| *n == name).map(|(_, t)| t.clone()));
            if !root.join("docker").join(&name).join("Dockerfile").is_file() {
                problems.push(format!(
                    "deploy/{file}: {image} is neither built by docker/build.sh (no docker/{name}/Dockerfile) nor listed in deploy/external-images.txt"
                ));
            } else if tag.as_deref() != Some(version.as_str()) {
                problems.push(format!(
                    "deploy/{file}: {name} is tagged {tag:?} (kustomization.yaml newTag), docker/build.sh tags it {version}"
                ));
            } else {
                corral_images.push(name);
            }
        }
    }
    for image in &external {
        if !used_external.contains(image) {
            problems.push(format!(
                "deploy/external-images.txt lists {image}, which no manifest uses"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    corral_images.sort();
    corral_images.dedup();
    eprintln!("Corral images: {corral_images:?}; external: {used_external:?}");
}

/// Works without kubectl (issue 40, mutual TLS on by default): the instance manager's pod issues the node's
/// certificate from the store's CA before it starts (an init container of the manager image running
/// `corral-manager --tls-issue-only`, with the node name, address, store and data directory the manager pod uses),
/// and loads it (`--tls-dir` in that data directory); no manifest turns TLS off or mounts certificate files of its
/// own (nothing is baked into an image or a Secret).
#[test]
fn the_instance_manager_runs_on_the_node_certificate_its_init_container_issues() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let im =
        std::fs::read_to_string(deploy.join("instance-manager.yaml")).expect("read instance-manager.yaml");
    let manager = std::fs::read_to_string(deploy.join("manager.yaml")).expect("read manager.yaml");
    let (init, main) = im
        .split_once("      containers:")
        .expect("instance-manager.yaml has a containers: list");
    let init = init
        .split_once("initContainers:")
        .map(|(_, i)| i)
        .expect("the instance manager's pod has an init container");
    assert!(
        init.contains("image: corral-manager") && init.contains("--tls-issue-only"),
        "the init container issues the node's certificate with the manager image:\n{init}"
    );
    for env in ["CORRAL_NODE_ID", "CORRAL_HOST", "CORRAL_STORE", "CORRAL_DATA_DIR"] {
        let value = |text: &str| {
            let at = text.find(&format!("name: {env}"))?;
            text[at..].lines().nth(1).map(|l| l.trim().to_owned())
        };
        assert_eq!(
            value(init),
            value(&manager),
            "{env}: the init container issues for the node the manager pod runs as"
        );
    }
    assert!(
        main.contains("--tls-dir=/var/lib/corral/tls"),
        "the instance manager loads the issued directory:\n{main}"
    );
    for file in kustomization_resources(&deploy) {
        let text = std::fs::read_to_string(deploy.join(&file)).expect("read a manifest");
        let env_off = text
            .split("name: CORRAL_TLS\n")
            .skip(1)
            .any(|rest| rest.lines().next().is_some_and(|l| l.contains("off")));
        assert!(
            !env_off && !text.contains("--tls=off") && !text.contains("\"--tls\", \"off\""),
            "{file} turns TLS off"
        );
        assert!(
            !text.contains("tls.key"),
            "{file} mounts certificate files of its own"
        );
    }
}
