//! Docker and compose for the packaging tests: whether a daemon answers, `docker/build.sh` from the suite's own
//! build, and compose projects that are always taken down.
//!
//! The docker daemon may be shared (CI, other sessions on the machine): a [`ComposeProject`] has a name of its own,
//! and its `Drop` removes its containers, networks and volumes, panics included.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Runs `cmd` and returns its output.
///
/// # Panics
/// When it cannot be spawned or exits non-zero, with its stdout and stderr.
pub fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("spawn {shown}: {e}"));
    if !out.status.success() {
        panic!(
            "{shown} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// A command's stdout, trimmed.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Why docker tests cannot run here (no client, no reachable daemon, no compose), if they cannot.
pub fn docker_unavailable() -> Option<String> {
    match Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
    {
        Err(e) => Some(format!("no docker client: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "`docker info` failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => compose_command()
            .is_none()
            .then(|| "neither docker-compose nor `docker compose` is installed".to_owned()),
    }
}

/// `docker-compose` (v1, Debian's package) or the `docker compose` plugin.
pub fn compose_command() -> Option<Vec<String>> {
    let ok = |argv: &[&str]| {
        Command::new(argv[0])
            .args(&argv[1..])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok(&["docker-compose", "version"]) {
        Some(vec!["docker-compose".into()])
    } else if ok(&["docker", "compose", "version"]) {
        Some(vec!["docker".into(), "compose".into()])
    } else {
        None
    }
}

/// The workspace root (the parent of the `testkit` crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit has a parent directory")
        .to_path_buf()
}

/// The target dir that built the running test: `$CARGO_TARGET_DIR`, else `<target>` of
/// `<target>/<profile>/deps/<test>-<hash>`.
pub fn target_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors()
        .nth(3)
        .map_or_else(|| repo_root().join("target"), Path::to_path_buf)
}

/// The workspace's Cargo version (that of package `replica`, as every crate shares it).
pub fn workspace_version() -> String {
    let out = run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["pkgid", "-p", "replica"])
            .current_dir(repo_root()),
    );
    // path+file:///work/main/replica#0.1.0
    let id = stdout(&out);
    id.rsplit(['#', '@'])
        .next()
        .expect("pkgid has a version")
        .to_owned()
}

/// `-S` for `CORRAL_TAG_SUFFIX=S` in the environment (else empty): the suffix `docker/build.sh` gives every tag of
/// one's own build, so another build on a shared docker daemon cannot replace the images a test runs.
pub fn own_tag_suffix() -> String {
    std::env::var("CORRAL_TAG_SUFFIX")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| format!("-{s}"))
        .unwrap_or_default()
}

/// The tag of a host program's image (`corral-etcd`) built by [`build_images`]: `latest`, or `latest-S` under
/// `CORRAL_TAG_SUFFIX=S`.
pub fn host_image_tag() -> String {
    format!("latest{}", own_tag_suffix())
}

/// Builds `images` with `docker/build.sh` from the `profile` build's binaries already in the target dir (no cargo
/// run) and returns the tag Corral's images carry (`<version>` for release, `<version>-<profile>` otherwise;
/// `CORRAL_TAG_SUFFIX`, passed on to the script, appends its `-S`).
pub fn build_images(profile: &str, images: &[&str]) -> String {
    let started = Instant::now();
    let build = run(Command::new(repo_root().join("docker/build.sh"))
        .args(images)
        .env("CARGO_TARGET_DIR", target_dir())
        .env("CORRAL_PROFILE", profile)
        .env("CORRAL_SKIP_CARGO", "1"));
    eprintln!("{}", stdout(&build));
    eprintln!("{profile} images built in {:.0?}", started.elapsed());
    let version = workspace_version();
    let suffix = own_tag_suffix();
    match profile {
        "release" => format!("{version}{suffix}"),
        _ => format!("{version}-{profile}{suffix}"),
    }
}

/// A compose project under a name of its own; `Drop` takes it down with its volumes (printing its logs first when
/// the test is failing).
pub struct ComposeProject {
    compose: Vec<String>,
    files: Vec<PathBuf>,
    name: String,
    env: Vec<(String, String)>,
}

impl ComposeProject {
    /// A project over `files` (relative to the workspace root), named `<prefix><pid>x<nanos>`, with `env` for
    /// compose's variable substitution. Nothing runs until a command is given.
    ///
    /// # Panics
    /// When no compose command is installed (check [`docker_unavailable`] first).
    pub fn new(prefix: &str, files: &[&str], env: Vec<(String, String)>) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        Self {
            compose: compose_command().expect("docker-compose or `docker compose`"),
            files: files.iter().map(|f| repo_root().join(f)).collect(),
            name: format!("{prefix}{}x{nanos}", std::process::id()),
            env,
        }
    }

    /// The project name (also the prefix of its networks and volumes: `<name>_<network>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `docker-compose --project-name NAME --file F...` with the project's environment; add the subcommand.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.compose[0]);
        c.args(&self.compose[1..]).arg("--project-name").arg(&self.name);
        for f in &self.files {
            c.arg("--file").arg(f);
        }
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    /// The id of the container of `service`.
    ///
    /// # Panics
    /// When the service has no container.
    pub fn container_id(&self, service: &str) -> String {
        let id = stdout(&run(self.command().args(["ps", "-q", service])));
        assert!(!id.is_empty(), "no container for service {service}");
        id
    }

    /// The last 40 log lines of every service.
    pub fn logs(&self) -> String {
        self.command()
            .args(["logs", "--no-color", "--tail", "40"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for ComposeProject {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- compose logs of {}\n{}", self.name, self.logs());
        }
        let down = self
            .command()
            .args(["down", "--volumes", "--remove-orphans", "--timeout", "10"])
            .output();
        match down {
            Ok(o) if o.status.success() => eprintln!("compose project {} removed", self.name),
            Ok(o) => eprintln!(
                "compose down of {} failed: {}",
                self.name,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("compose down of {}: {e}", self.name),
        }
    }
}

/// The health of a container (`healthy`, `unhealthy`, `starting`; empty when it has no probe or is gone).
pub fn health(container: &str) -> String {
    Command::new("docker")
        .args(["inspect", "--format", "{{.State.Health.Status}}", container])
        .output()
        .map(|o| stdout(&o))
        .unwrap_or_default()
}
