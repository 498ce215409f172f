//! Recurring jobs through the control plane, with real manager, engine and replica processes: a snapshot job on a
//! seconds schedule keeps the newest `retain` snapshots of its volumes, skips a detached one, runs each fire time
//! exactly once across a SIGKILL and restart of the manager, and stops when deleted; bad requests are refused.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;
use testkit::{qemu_io, wait_for};

/// Seconds between the test job's fire times.
const PERIOD: i64 = 4;

fn job(m: &Manager, name: &str) -> serde_json::Value {
    let (code, v) = rest("GET", &format!("{}/v1/recurringjobs/{name}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

/// The snapshot names of `volume` that the manager's log says a run of `job` made (one per run and volume).
fn runs_in_log(m: &Manager, job: &str, volume: &str) -> Vec<String> {
    m.log()
        .lines()
        .filter(|l| l.contains("recurring job ran") && l.contains(volume))
        .map(|l| {
            let at = l
                .find(&format!("snapshot {job}-"))
                .unwrap_or_else(|| panic!("a run of {volume} did not take a snapshot: {l}"));
            l[at + "snapshot ".len()..]
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

fn fire_time(snapshot: &str) -> i64 {
    let stamp = &snapshot[snapshot.len() - 15..];
    chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%d-%H%M%S")
        .unwrap_or_else(|e| panic!("{snapshot}: {e}"))
        .and_utc()
        .timestamp()
}

/// Waits until the job has claimed `n` more fire times than `seen` holds, recording each one it sees.
fn wait_runs(m: &Manager, name: &str, seen: &mut BTreeSet<i64>, n: usize) {
    let want = seen.len() + n;
    wait_for(
        &format!("{n} more runs of {name}"),
        Duration::from_secs(u64::try_from(PERIOD).unwrap() * (u64::try_from(n).unwrap() + 3)),
        || {
            let j = job(m, name);
            if let Some(t) = j["lastScheduled"].as_i64().filter(|t| *t > 0) {
                seen.insert(t);
            }
            (seen.len() >= want).then_some(())
        },
    );
}

fn wait_finished(m: &Manager, name: &str) -> serde_json::Value {
    wait_for(
        &format!("the run of {name} to finish"),
        Duration::from_secs(60),
        || {
            let j = job(m, name);
            (j["lastFinished"].as_i64().unwrap_or(0) > 0).then_some(j)
        },
    )
}

#[test]
fn a_snapshot_job_keeps_its_newest_snapshots_and_runs_each_fire_time_once_across_a_manager_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    for v in ["vol-a", "vol-b"] {
        let (ok, out, err) = corral(
            &url,
            &["volume", "create", v, "--size", "16Mi", "--replicas", "1"],
        );
        assert!(ok, "{out}{err}");
    }
    let (ok, out, err) = corral(&url, &["volume", "attach", "vol-a", "--timeout", "90"]);
    assert!(ok, "{out}{err}");
    let uri = out
        .lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .expect("attach prints the NBD URI")
        .to_owned();
    let (ok, o) = qemu_io(&uri, &["write -P 0x3c 0 1M", "flush"]);
    assert!(ok, "{o}");
    // vol-b joins the job through its group, and stays detached: skipped, not failed.
    let (ok, out, err) = corral(&url, &["job", "groups", "vol-b", "nightly"]);
    assert!(ok && out.contains("nightly"), "{out}{err}");

    // Refused: each says what is wrong, and nothing is created.
    let base =
        json!({"name": "bad", "task": "snapshot", "cron": "* * * * *", "retain": 2, "volumes": ["vol-a"]});
    for (change, want) in [
        (json!({"cron": "61 * * * *"}), "minute field"),
        (json!({"cron": "* * *"}), "expected 5 fields"),
        (json!({"retain": 0}), "retain 0"),
        (json!({"task": "defrag"}), "task \"defrag\""),
        (json!({"name": "../x"}), "not a valid name"),
        (json!({"concurrency": 0}), "concurrency 0"),
    ] {
        let mut body = base.clone();
        for (k, v) in change.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, v) = rest("POST", &format!("{url}/v1/recurringjobs"), Some(&body));
        assert_eq!(code, 400, "{body}: {v}");
        assert!(
            v["message"].as_str().is_some_and(|s| s.contains(want)),
            "{body}: {v}"
        );
    }
    let (code, v) = rest("GET", &format!("{url}/v1/recurringjobs"), None);
    assert_eq!((code, v.as_array().map(Vec::len)), (200, Some(0)), "{v}");
    let (code, v) = rest(
        "PUT",
        &format!("{url}/v1/volumes/nope/jobgroups"),
        Some(&json!({"groups": ["g"]})),
    );
    assert_eq!(code, 404, "{v}");

    let cron = format!("*/{PERIOD} * * * * *");
    let (ok, out, err) = corral(
        &url,
        &[
            "job",
            "create",
            "every4",
            "--task",
            "snapshot",
            "--cron",
            &cron,
            "--retain",
            "2",
            "--volume",
            "vol-a",
            "--group",
            "nightly",
            "--label",
            "tier=gold",
        ],
    );
    assert!(ok, "{out}{err}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/recurringjobs"),
        Some(
            &json!({"name": "every4", "task": "snapshot", "cron": "* * * * *", "retain": 1, "volumes": ["vol-a"]}),
        ),
    );
    assert_eq!(code, 409, "a second job of the same name: {v}");

    let mut seen = BTreeSet::new();
    wait_runs(&m, "every4", &mut seen, 3);
    let j = wait_finished(&m, "every4");
    assert_eq!(j["lastResults"]["vol-b"], "skipped: not attached", "{j}");

    // SIGKILL the manager just after a run finished, and start it again at once: its engine and replica keep
    // running, and the next fire times are each run once.
    m.kill();
    let down = Instant::now();
    m.restart();
    let restarted_in = down.elapsed();
    wait_runs(&m, "every4", &mut seen, 3);
    let j = wait_finished(&m, "every4");
    assert!(
        j["lastResults"]["vol-a"]
            .as_str()
            .is_some_and(|r| r.starts_with("snapshot every4-")),
        "{j}"
    );
    assert_eq!(
        j["lastMissed"], 0,
        "nothing missed while the manager restarted: {j}"
    );

    // Each fire time ran once (a second run would have failed on the snapshot name, or logged it twice), and the
    // fire times follow each other without a gap across the restart.
    let runs = runs_in_log(&m, "every4", "vol-a");
    let fires: Vec<i64> = runs.iter().map(|s| fire_time(s)).collect();
    let distinct: BTreeSet<i64> = fires.iter().copied().collect();
    assert_eq!(distinct.len(), fires.len(), "a fire time ran twice: {runs:?}");
    assert!(fires.len() >= 6, "{runs:?}");
    for w in fires.windows(2) {
        assert_eq!(
            w[1] - w[0],
            PERIOD,
            "fire times skipped or out of order (manager restarted in {restarted_in:?}): {runs:?}"
        );
    }

    // Retention: exactly the two newest of the job's snapshots remain, carrying the job's labels.
    let newest: Vec<&String> = runs.iter().rev().take(2).collect();
    let (code, snaps) = rest("GET", &format!("{url}/v1/volumes/vol-a/snapshots"), None);
    assert_eq!(code, 200, "{snaps}");
    let kept: Vec<&serde_json::Value> = snaps
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["labels"]["corral.io/recurring-job"] == "every4" && s["removed"] == false)
        .collect();
    let kept_names: BTreeSet<&str> = kept.iter().filter_map(|s| s["name"].as_str()).collect();
    let newest_names: BTreeSet<&str> = newest.iter().map(|s| s.as_str()).collect();
    assert_eq!(kept_names, newest_names, "{snaps}");
    assert!(kept.iter().all(|s| s["labels"]["tier"] == "gold"), "{snaps}");

    let (ok, out, err) = corral(&url, &["job", "ls"]);
    assert!(
        ok && out.contains("every4") && out.contains("group:nightly"),
        "{out}{err}"
    );
    let (ok, out, err) = corral(&url, &["--json", "job", "get", "every4"]);
    assert!(ok, "{out}{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["retain"], 2, "{j}");

    // Deleted: no more runs (the snapshots it made stay).
    let (ok, out, err) = corral(&url, &["job", "rm", "every4"]);
    assert!(ok, "{out}{err}");
    let before = runs_in_log(&m, "every4", "vol-a").len();
    // Absence cannot be polled for: watch two periods go by.
    std::thread::sleep(Duration::from_secs(u64::try_from(PERIOD * 2 + 1).unwrap()));
    // A run that had started before the delete may still log; none starts after it.
    assert!(runs_in_log(&m, "every4", "vol-a").len() <= before + 1);
    let (code, _) = rest("GET", &format!("{url}/v1/recurringjobs/every4"), None);
    assert_eq!(code, 404);
}
