//! Recurring jobs: a snapshot or backup task run on a cron schedule over volumes chosen by name or group, keeping
//! the newest `retain` of what each job made per volume ([`snapshot_task`], [`backup_task`]). Jobs run on the
//! leader only; a fire time is claimed in the store before its run starts, so neither a manager restart nor a
//! change of leader runs it twice. Fire times are run in order: one at most [`GRACE`] old that no manager claimed
//! (a restart, a change of leader) is still run; older ones are recorded as missed and not caught up.

pub mod backup_task;
pub mod cli;
pub mod controller;
pub mod cron;
pub mod model;
pub mod openapi;
pub mod routes;
pub mod snapshot_task;

use std::time::Duration;

/// How late a fire time may still be run: a manager restarting within this window runs the fire time it would
/// otherwise have missed; beyond it the run is recorded as missed.
pub const GRACE: Duration = Duration::from_secs(60);

/// What the scheduler does with a job now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Claim and run this fire time (unix seconds).
    Run(i64),
    /// This fire time passed more than [`GRACE`] ago unclaimed: record it as missed.
    Missed(i64),
    /// Nothing is due; look again at this time (unix seconds), if the schedule ever fires again.
    Wait(Option<i64>),
}

/// The scheduler's one rule, a pure function of the schedule, the last fire time claimed, the job's creation and
/// the time now (all unix seconds). Fire times are run in order, each once: the earliest unclaimed one is due
/// while it is at most [`GRACE`] old, so a manager restart or a change of leader that takes less than the grace
/// skips none; older unclaimed ones are recorded missed at once (the latest of them), not caught up.
pub fn decide(cron: &cron::Cron, last_scheduled: i64, created: i64, now: i64) -> Decision {
    let at = |t: i64| chrono::DateTime::from_timestamp(t, 0).unwrap_or_default();
    let next = |t: i64| cron.next(at(t)).map(|n| n.timestamp());
    let prev = |t: i64| cron.previous(at(t)).map(|p| p.timestamp());
    // The first fire time not claimed yet and not before the job existed.
    let Some(first) = next(last_scheduled.max(created - 1)) else {
        return Decision::Wait(None);
    };
    if first > now {
        return Decision::Wait(Some(first));
    }
    let grace = i64::try_from(GRACE.as_secs()).unwrap_or(60);
    if now - first <= grace {
        return Decision::Run(first);
    }
    // Stale: the latest fire time older than the grace is recorded missed; those after it are run in order.
    Decision::Missed(prev(now - grace - 1).unwrap_or(first).max(first))
}

/// Of the items a job made on one volume (name, creation time), the ones to remove so that the newest `retain`
/// remain. `retain` 0 keeps nothing; ties in time are broken by name so every leader picks the same ones.
pub fn beyond_retention<T: AsRef<str>>(items: &[(T, i64)], retain: u32) -> Vec<String> {
    let mut sorted: Vec<(&str, i64)> = items.iter().map(|(n, t)| (n.as_ref(), *t)).collect();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| b.0.cmp(a.0)));
    sorted
        .into_iter()
        .skip(usize::try_from(retain).unwrap_or(usize::MAX))
        .map(|(n, _)| n.to_owned())
        .collect()
}

/// The name a run gives the snapshot it takes: the job and the fire time, unique per run and sortable.
pub fn snapshot_name(job: &str, fire: i64) -> String {
    let t = chrono::DateTime::from_timestamp(fire, 0).unwrap_or_default();
    format!("{job}-{}", t.format("%Y%m%d-%H%M%S"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> i64 {
        chrono::DateTime::parse_from_rfc3339(s).unwrap().timestamp()
    }

    #[test]
    fn the_scheduler_runs_each_fire_time_once_and_never_catches_up() {
        let c = cron::Cron::parse("*/5 * * * *").unwrap();
        let created = t("2026-11-24T10:02:00Z");
        // Created between fire times: nothing due until 10:05.
        assert_eq!(
            decide(&c, 0, created, t("2026-11-24T10:03:00Z")),
            Decision::Wait(Some(t("2026-11-24T10:05:00Z")))
        );
        // 10:05 due, 20 s late: run it.
        let fire = t("2026-11-24T10:05:00Z");
        assert_eq!(decide(&c, 0, created, fire + 20), Decision::Run(fire));
        // Claimed: a restarted manager at 10:05:40 does not run it again.
        assert_eq!(
            decide(&c, fire, created, fire + 40),
            Decision::Wait(Some(t("2026-11-24T10:10:00Z")))
        );
        // A manager back at 10:05:50 that had not claimed it still runs it (within the grace).
        assert_eq!(decide(&c, 0, created, fire + 50), Decision::Run(fire));
        // Down from 10:04 to 10:12: 10:10 is 2 minutes old, missed and not run.
        assert_eq!(
            decide(&c, t("2026-11-24T10:00:00Z"), created, t("2026-11-24T10:12:00Z")),
            Decision::Missed(t("2026-11-24T10:10:00Z"))
        );
        // Once recorded missed, the next due is 10:15.
        assert_eq!(
            decide(&c, t("2026-11-24T10:10:00Z"), created, t("2026-11-24T10:12:00Z")),
            Decision::Wait(Some(t("2026-11-24T10:15:00Z")))
        );
    }

    #[test]
    fn fire_times_within_the_grace_are_run_in_order_after_a_leader_change() {
        let c = cron::Cron::parse("*/5 * * * * *").unwrap();
        let created = t("2026-11-24T10:00:00Z");
        let last = t("2026-11-24T10:00:05Z");
        // No leader from 10:00:07 to 10:00:21: 10:00:10, :15 and :20 are run one after the other.
        let now = t("2026-11-24T10:00:21Z");
        assert_eq!(decide(&c, last, created, now), Decision::Run(last + 5));
        assert_eq!(decide(&c, last + 5, created, now), Decision::Run(last + 10));
        assert_eq!(decide(&c, last + 10, created, now), Decision::Run(last + 15));
        assert_eq!(
            decide(&c, last + 15, created, now),
            Decision::Wait(Some(last + 20))
        );
        // Down for 3 minutes: everything older than 60 s is missed in one step, the rest is run.
        let now = t("2026-11-24T10:03:02Z");
        assert_eq!(
            decide(&c, last, created, now),
            Decision::Missed(t("2026-11-24T10:02:00Z"))
        );
        assert_eq!(
            decide(&c, t("2026-11-24T10:02:00Z"), created, now),
            Decision::Run(t("2026-11-24T10:02:05Z"))
        );
        // A schedule that never fires again waits for nothing.
        let feb30 = cron::Cron::parse("0 0 30 2 *").unwrap();
        assert_eq!(decide(&feb30, 0, created, now), Decision::Wait(None));
    }

    #[test]
    fn retention_keeps_the_newest_and_breaks_ties_by_name() {
        let items = [("a", 1), ("b", 3), ("c", 2), ("d", 3)];
        assert_eq!(beyond_retention(&items, 2), vec!["c", "a"]);
        assert_eq!(beyond_retention(&items, 4), Vec::<String>::new());
        assert_eq!(beyond_retention(&items, 0), vec!["d", "b", "c", "a"]);
        assert_eq!(beyond_retention(&items[..0], 1), Vec::<String>::new());
    }

    #[test]
    fn run_snapshots_are_named_after_the_job_and_fire_time() {
        assert_eq!(
            snapshot_name("hourly", t("2026-11-24T10:05:00Z")),
            "hourly-20261124-100500"
        );
    }
}
