//! Packaging end to end: `docker/build.sh` builds every image, each answers `--version` and `--help`, the compose
//! cluster of `docker/compose.yaml` (an engine over three replica containers) serves a volume to `qemu-io` on the
//! host through NBD, and keeps serving it after one replica container is killed, with the engine reporting that
//! replica ERR. Skipped, with the reason printed, when no Docker daemon answers.
//!
//! The docker daemon may be shared (CI, other sessions): the compose project name and the published port are unique
//! to this run, and the project is torn down (containers, networks, volumes) on every exit, panics included.

use std::process::Command;
use std::time::{Duration, Instant};

use testkit::docker::{
    ComposeProject, build_images, docker_unavailable, health, repo_root, run, stdout, workspace_version,
};

/// Runtime images should stay under this (issue 11); `docker/build.sh` prints the sizes.
const MAX_IMAGE_MIB: f64 = 60.0;
/// The images that exist today: one per binary of the workspace that has a `docker/<binary>/Dockerfile`.
const IMAGES: &[&str] = &[
    "corral-replica",
    "corral-engine",
    "corral-sync",
    "corral-datasource",
    "corral-bim",
    "corral-manager",
    "corral-csi",
    "corral-im",
];

/// `qemu-io` on the engine's published NBD port: each pair is a write then a verifying read of that pattern.
fn qemu_io(uri: &str, ops: &[&str]) {
    let (ok, text) = testkit::qemu_io(uri, ops);
    assert!(ok, "qemu-io {ops:?}:\n{text}");
}

/// Replica address → mode, as the engine reports them (`corral-engine replica ls --json` inside its container).
fn replica_modes(engine_container: &str) -> Option<Vec<(String, String)>> {
    let out = Command::new("docker")
        .args([
            "exec",
            engine_container,
            "corral-engine",
            "replica",
            "ls",
            "--json",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(
        v["replicas"]
            .as_array()?
            .iter()
            .map(|r| {
                (
                    r["address"].as_str().unwrap_or_default().to_owned(),
                    r["mode"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect(),
    )
}

/// Size of an image in MiB, as `docker image inspect` reports it.
fn image_mib(reference: &str) -> f64 {
    let bytes: f64 = stdout(&run(Command::new("docker").args([
        "image",
        "inspect",
        "--format",
        "{{.Size}}",
        reference,
    ])))
    .parse()
    .expect("image size");
    bytes / 1048576.0
}

/// Release images fit their size targets. Not in CI (the suite builds no release binaries): run it with
/// `cargo build --release --bins && cargo nextest run -p integration-tests --run-ignored ignored-only`.
#[test]
#[ignore = "needs release binaries: cargo build --release --bins"]
fn release_images_fit_their_size_targets() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED release image sizes: {reason}");
        return;
    }
    let repo = repo_root();
    let tag = build_images("release", IMAGES);
    for image in IMAGES {
        let reference = format!("{image}:{tag}");
        let mib = image_mib(&reference);
        // An image carrying several binaries (the manager's) states its own target in docker/<image>/max-mib.
        let max_mib = std::fs::read_to_string(repo.join("docker").join(image).join("max-mib"))
            .map_or(MAX_IMAGE_MIB, |s| {
                s.trim().parse().expect("docker/<image>/max-mib holds a number")
            });
        eprintln!("{reference}: {mib:.1} MiB (target {max_mib} MiB)");
        assert!(mib < max_mib, "{reference} is {mib:.1} MiB, over {max_mib} MiB");
    }
}

#[test]
fn images_build_and_compose_cluster_keeps_serving_nbd_after_a_replica_container_is_killed() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED containers test: {reason}");
        return;
    }
    let started = Instant::now();
    let version = workspace_version();

    // 1. Images, from the debug binaries the suite already built (`cargo build --workspace --bins`): one build
    // serves the tests and the images. Their sizes are release's concern (the ignored test above).
    let tag = build_images("debug", IMAGES);
    for image in IMAGES {
        let reference = format!("{image}:{tag}");
        eprintln!("{reference}: {:.1} MiB", image_mib(&reference));
        let v = stdout(&run(Command::new("docker").args([
            "run",
            "--rm",
            &reference,
            "--version",
        ])));
        assert_eq!(v, format!("{image} {version}"), "{reference} --version");
        let help = stdout(&run(
            Command::new("docker").args(["run", "--rm", &reference, "--help"])
        ));
        assert!(help.contains("Usage:"), "{reference} --help:\n{help}");
        let labels = stdout(&run(Command::new("docker").args([
            "image",
            "inspect",
            "--format",
            "{{index .Config.Labels \"org.opencontainers.image.version\"}} {{.Config.User}}",
            &reference,
        ])));
        assert_eq!(
            labels,
            format!("{version} 10001:10001"),
            "{reference} version label and user"
        );
    }

    // 2. The compose cluster, under a project name and host port of its own.
    let project = ComposeProject::new(
        "corraltest",
        &["docker/compose.yaml"],
        vec![
            ("CORRAL_TAG".into(), tag.clone()),
            // Empty: docker publishes the NBD port on a free host port of its choosing (read back below).
            ("CORRAL_NBD_PORT".into(), String::new()),
            ("CORRAL_VOLUME_SIZE".into(), "256M".into()),
        ],
    );
    let up = Instant::now();
    run(project.command().args(["up", "-d"]));
    let engine = project.container_id("engine");
    testkit::wait_for(
        "the engine container to be healthy",
        Duration::from_secs(90),
        || (health(&engine) == "healthy").then_some(()),
    );
    let modes = testkit::wait_for("three RW replicas", Duration::from_secs(30), || {
        replica_modes(&engine).filter(|m| m.len() == 3 && m.iter().all(|(_, mode)| mode == "RW"))
    });
    eprintln!("cluster up in {:.0?}: {modes:?}", up.elapsed());

    // 3. IO from the host through the published NBD port.
    let published = stdout(&run(project.command().args(["port", "engine", "10809"])));
    let uri = format!("nbd://{published}");
    qemu_io(
        &uri,
        &[
            "write -P 0xab 0 4M",
            "read -P 0xab 0 4M",
            "write -P 0x5c 100M 1M",
            "flush",
        ],
    );

    // 4. Lose a node: SIGKILL replica-2's container. The volume keeps serving: old data reads back, new writes
    // verify, and the engine has put exactly that replica out (ERR).
    let victim = project.container_id("replica-2");
    run(Command::new("docker").args(["kill", &victim]));
    qemu_io(
        &uri,
        &[
            "read -P 0xab 0 4M",
            "read -P 0x5c 100M 1M",
            "write -P 0xcd 8M 4M",
            "read -P 0xcd 8M 4M",
            "flush",
        ],
    );
    let modes = testkit::wait_for("replica-2 reported ERR", Duration::from_secs(30), || {
        replica_modes(&engine).filter(|m| {
            m.iter()
                .all(|(addr, mode)| (mode == "ERR") == addr.contains("replica-2"))
        })
    });
    eprintln!("after killing replica-2: {modes:?}");
    // Still serving after the engine noticed.
    qemu_io(&uri, &["read -P 0xab 0 4M", "read -P 0xcd 8M 4M"]);

    drop(project);
    eprintln!("containers test took {:.0?}", started.elapsed());
}
