//! `corral up` and `corral down`: a single-node manager on the embedded store (foreground or detached, reported in
//! DATA_DIR/manager.ready), and its stop (volumes detached through the API, then the manager and the daemons it
//! left under DATA_DIR).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use corral_daemon::output::emit;
use manager::client::Client;
use manager::model::VolumeState;
use manager::node::views::NodeView;
use manager::volume::views::VolumeView;

/// Where `corral up` reports the manager it runs (`{pid, listen: {http}}`, written atomically once it serves).
const MANAGER_READY_FILE: &str = "manager.ready";

pub async fn up(
    data_dir: PathBuf,
    listen: SocketAddr,
    store: String,
    node_id: String,
    detach: bool,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    let data_dir = data_dir.canonicalize()?;
    let ready = data_dir.join(MANAGER_READY_FILE);
    if let Some(running) = running_manager(&ready) {
        bail!(
            "a corral manager already runs on {} (pid {}, http://{}): `corral down --data-dir {}` first",
            data_dir.display(),
            running.pid,
            running.listen.get("http").map_or("?", String::as_str),
            data_dir.display()
        );
    }
    if detach {
        std::fs::create_dir_all(data_dir.join("logs"))?;
        let log = data_dir.join("logs").join("manager.log");
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let exe = std::env::current_exe()?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--listen")
            .arg(listen.to_string())
            .args(["--store", &store, "--node-id", &node_id])
            .stdin(std::process::Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let _ = std::fs::remove_file(&ready);
        let mut child = cmd.spawn().context("start the manager")?;
        let end = Instant::now() + Duration::from_secs(30);
        let report = loop {
            match corral_daemon::ready::ReadyReport::read(&ready) {
                Ok(r) if r.pid == child.id() => break r,
                _ => {}
            }
            if let Some(st) = child.try_wait()? {
                bail!(
                    "the manager exited ({st}) before it served; log: {}",
                    log.display()
                );
            }
            if Instant::now() > end {
                bail!("the manager did not serve within 30 s (log: {})", log.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        emit(&format!(
            "corral manager running (pid {}) at http://{}; log {}; stop it with: corral down --data-dir {}",
            report.pid,
            report.listen.get("http").map_or("?", String::as_str),
            log.display(),
            data_dir.display()
        ));
        return Ok(());
    }
    let cfg = manager::server::ServerConfig {
        data_dir,
        listen,
        store,
        node_id,
        host: listen.ip().to_string(),
        storage_host: None,
        bin_dir: manager::server::default_bin_dir(),
        port_range: (20000, 30000),
        ready_file: Some(ready.clone()),
        instance_manager: None,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        admin_token_file: None,
        tls_dir: None,
        tls_auto: true,
    };
    let result = manager::server::run(cfg, corral_daemon::shutdown_on_signal()).await;
    // A clean stop leaves no report behind: `corral down` then says nothing runs.
    if corral_daemon::ready::ReadyReport::read(&ready).is_ok_and(|r| r.pid == std::process::id()) {
        let _ = std::fs::remove_file(&ready);
    }
    result
}

/// `/proc/PID`'s state letter, `None` when there is no such process.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `PID (COMM) STATE ...`: COMM may hold spaces and parentheses, the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Alive: exists and is not a zombie waiting for its parent.
fn alive(pid: u32) -> bool {
    process_state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// The executable's file name of a live process.
fn exe_name(pid: u32) -> Option<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    Some(
        exe.file_name()?
            .to_string_lossy()
            .trim_end_matches(" (deleted)")
            .to_owned(),
    )
}

/// The manager a ready file names, when that process still runs a Corral binary (not a stale report of a crashed
/// manager whose pid now belongs to something else).
fn running_manager(ready: &std::path::Path) -> Option<corral_daemon::ready::ReadyReport> {
    let r = corral_daemon::ready::ReadyReport::read(ready).ok()?;
    (alive(r.pid) && exe_name(r.pid).is_some_and(|n| n.starts_with("corral"))).then_some(r)
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if let Ok(p) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), sig);
    }
}

/// SIGTERM, wait up to `timeout` for every pid to exit, SIGKILL the rest. Returns the pids that had to be killed.
async fn terminate(pids: &[u32], timeout: Duration) -> Vec<u32> {
    for &p in pids {
        signal(p, nix::sys::signal::Signal::SIGTERM);
    }
    let end = Instant::now() + timeout;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let killed: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &killed {
        signal(p, nix::sys::signal::Signal::SIGKILL);
    }
    let end = Instant::now() + Duration::from_secs(5);
    while killed.iter().any(|&p| alive(p)) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    killed
}

/// Corral daemons (`corral-*`) whose command line names `dir`: what a manager on `dir` started.
fn daemons_under(dir: &std::path::Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id() && alive(p))
        .filter_map(|p| {
            let name = exe_name(p).filter(|n| n.starts_with("corral-"))?;
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(&needle)
                .then_some((p, name))
        })
        .collect()
}

/// Detaches the volumes attached to the node of the manager at `c`, waiting for each.
async fn detach_node_volumes(c: &Client, timeout: Duration) -> anyhow::Result<()> {
    let nodes: Vec<NodeView> = c.get("/v1/nodes").await?;
    let node = nodes
        .iter()
        .find(|n| n.address.trim_end_matches('/') == c.base())
        .map(|n| n.name.clone());
    let vols: Vec<VolumeView> = c.get("/v1/volumes").await?;
    let mine: Vec<&VolumeView> = vols
        .iter()
        .filter(|v| {
            let on = v.node_id.as_ref().or(v.current_node_id.as_ref());
            on.is_some() && (node.is_none() || on == node.as_ref())
        })
        .collect();
    if mine.is_empty() {
        emit("no attached volumes");
    }
    for v in mine {
        emit(&format!("detaching volume {}", v.name));
        c.post::<VolumeView>(&format!("/v1/volumes/{}/detach", v.name), &())
            .await?;
        manager::volume::cli::wait_volume(c, &v.name, timeout, &format!("detaching {}", v.name), |v| {
            v.state == VolumeState::Detached && v.node_id.is_none()
        })
        .await?;
        emit(&format!("volume {} detached", v.name));
    }
    Ok(())
}

pub async fn down(data_dir: PathBuf, token: Option<String>, timeout: Duration) -> anyhow::Result<()> {
    let data_dir = data_dir.canonicalize().unwrap_or(data_dir);
    let ready = data_dir.join(MANAGER_READY_FILE);
    let report = match corral_daemon::ready::ReadyReport::read(&ready) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            emit(&format!(
                "no corral manager runs on {} (no {}): nothing to stop",
                data_dir.display(),
                ready.display()
            ));
            return Ok(());
        }
        Err(e) => bail!("cannot read {}: {e}", ready.display()),
    };
    let manager_runs = running_manager(&ready).is_some();
    if manager_runs {
        let addr = report.listen.get("http").cloned().unwrap_or_default();
        // The data directory's admin.token may be new since main looked (the manager made it after this started).
        let token = token.or_else(|| {
            manager::token::cli::find_token(None, None, &data_dir)
                .ok()
                .flatten()
        });
        let c = Client::new(&addr).with_token(token);
        emit(&format!(
            "stopping the corral manager on {} (pid {}, http://{addr})",
            data_dir.display(),
            report.pid
        ));
        // Volumes go first, through the API: their engines stop cleanly and the store says detached.
        if let Err(e) = detach_node_volumes(&c, timeout).await {
            eprintln!("corral: warning: volumes not detached cleanly ({e:#}); stopping anyway");
        }
        if terminate(&[report.pid], timeout).await.is_empty() {
            emit(&format!("manager (pid {}) stopped", report.pid));
        } else {
            emit(&format!(
                "manager (pid {}) did not stop within {timeout:?} of SIGTERM: killed",
                report.pid
            ));
        }
    } else {
        emit(&format!(
            "the manager {} names (pid {}) is not running: it crashed or was killed; removing the stale file",
            ready.display(),
            report.pid
        ));
    }
    let _ = std::fs::remove_file(&ready);
    let left = daemons_under(&data_dir);
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|(p, n)| format!("{n} (pid {p})")).collect();
        emit(&format!("stopping the daemons it left: {}", names.join(", ")));
        let pids: Vec<u32> = left.iter().map(|(p, _)| *p).collect();
        let killed = terminate(&pids, timeout).await;
        if !killed.is_empty() {
            emit(&format!("killed after {timeout:?}: {killed:?}"));
        }
    }
    emit("stopped");
    Ok(())
}
