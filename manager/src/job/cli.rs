//! `corral job create|ls|get|rm|groups`: recurring jobs as tables or `--json`.

use std::collections::BTreeMap;

use anyhow::bail;
use clap::Subcommand;

use super::model::Task;
use super::routes::{GroupsRequest, GroupsView, JobCreate, JobView};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum JobCmd {
    /// Create a job: `--task snapshot --cron "*/5 * * * *" --retain 3 --volume V` (schedules are UTC).
    Create(Box<CreateArgs>),
    /// List the jobs: task, schedule, retention, volumes and groups, next run.
    Ls,
    /// Show one job: schedule, retention, what it applies to, its last and next run.
    Get { name: String },
    /// Delete a job; the snapshots and backups it made stay.
    Rm { name: String },
    /// Set the groups a volume belongs to (jobs with `--group G` apply to it); no group clears them.
    Groups { volume: String, groups: Vec<String> },
}

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    name: String,
    /// snapshot | backup.
    #[arg(long)]
    task: String,
    /// minute hour day-of-month month day-of-week, in UTC (a sixth, leading field counts seconds).
    #[arg(long)]
    cron: String,
    /// How many of the job's snapshots (or backups) each volume keeps.
    #[arg(long)]
    retain: u32,
    /// Volumes worked on at once.
    #[arg(long)]
    concurrency: Option<u32>,
    /// A volume the job applies to (repeatable).
    #[arg(long = "volume")]
    volumes: Vec<String>,
    /// A group the job applies to (repeatable): every volume in it (`corral job groups VOLUME GROUP...`).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// A label for what the job makes, `key=value` (repeatable).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Backup task: the backup target (a name `corral backup target set --name` gave; default: `default`).
    #[arg(long)]
    target: Option<String>,
    /// Backup task: the job's backup-delta-max (backups in a chain, its full one included) over the setting's.
    #[arg(long)]
    delta_max: Option<u32>,
}

fn when(t: i64) -> String {
    if t <= 0 {
        return "-".to_owned();
    }
    chrono::DateTime::from_timestamp(t, 0)
        .map_or_else(|| t.to_string(), |d| d.format("%Y-%m-%d %H:%M:%SZ").to_string())
}

fn list_table(js: &[JobView]) -> String {
    corral_daemon::output::table(
        &[
            "NAME",
            "TASK",
            "CRON",
            "RETAIN",
            "APPLIES TO",
            "LAST RUN",
            "NEXT RUN",
        ],
        js.iter()
            .map(|j| {
                let mut to: Vec<String> = j.volumes.clone();
                to.extend(j.groups.iter().map(|g| format!("group:{g}")));
                vec![
                    j.name.clone(),
                    j.task.to_string(),
                    j.cron.clone(),
                    j.retain.to_string(),
                    to.join(","),
                    when(j.status.last_scheduled),
                    when(j.status.next_run),
                ]
            })
            .collect(),
    )
    .to_string()
}

fn detail(j: &JobView) -> String {
    let mut s = list_table(std::slice::from_ref(j));
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s.push_str(&format!("concurrency: {}\n", j.concurrency));
    if j.task == Task::Backup {
        s.push_str(&format!(
            "target: {}\n",
            j.target
                .as_deref()
                .unwrap_or(crate::backup::model::DEFAULT_TARGET)
        ));
        s.push_str(&match j.delta_max {
            Some(n) => format!("backup-delta-max: {n} (the job's)\n"),
            None => "backup-delta-max: the setting's\n".to_owned(),
        });
    }
    for (k, v) in &j.labels {
        s.push_str(&format!("label {k}={v}\n"));
    }
    if j.status.last_missed > 0 {
        s.push_str(&format!(
            "last missed: {} (no manager was up to run it)\n",
            when(j.status.last_missed)
        ));
    }
    if j.status.last_scheduled > 0 && j.status.last_finished == 0 {
        s.push_str("last run: still running\n");
    }
    for (v, r) in &j.status.last_results {
        s.push_str(&format!("  {v}: {r}\n"));
    }
    s
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    Ok(corral_daemon::output::print(json, v, human)?)
}

pub async fn run(c: &Client, json: bool, cmd: JobCmd) -> anyhow::Result<()> {
    match cmd {
        JobCmd::Create(args) => {
            let mut labels = BTreeMap::new();
            for l in &args.labels {
                let Some((k, v)) = l.split_once('=') else {
                    bail!("label {l:?}: expected key=value");
                };
                labels.insert(k.to_owned(), v.to_owned());
            }
            let req = JobCreate {
                name: args.name,
                task: args.task,
                cron: args.cron,
                retain: args.retain,
                concurrency: args.concurrency,
                volumes: args.volumes,
                groups: args.groups,
                labels,
                target: args.target,
                delta_max: args.delta_max,
            };
            let j: JobView = c.post("/v1/recurringjobs", &req).await?;
            print(json, &j, || detail(&j))
        }
        JobCmd::Ls => {
            let js: Vec<JobView> = c.get("/v1/recurringjobs").await?;
            print(json, &js, || list_table(&js))
        }
        JobCmd::Get { name } => {
            let j: JobView = c.get(&format!("/v1/recurringjobs/{name}")).await?;
            print(json, &j, || detail(&j))
        }
        JobCmd::Rm { name } => {
            c.delete(&format!("/v1/recurringjobs/{name}")).await?;
            Ok(())
        }
        JobCmd::Groups { volume, groups } => {
            let g: GroupsView = c
                .put(
                    &format!("/v1/volumes/{volume}/jobgroups"),
                    &GroupsRequest { groups },
                )
                .await?;
            print(json, &g, || {
                if g.groups.is_empty() {
                    format!("volume {} belongs to no group\n", g.volume)
                } else {
                    format!("volume {} belongs to {}\n", g.volume, g.groups.join(", "))
                }
            })
        }
    }
}
