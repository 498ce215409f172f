//! Debugging CLI commands that talk to a running replica over gRPC, or read a directory offline.

use std::time::Duration;

use anyhow::{Context, bail};
use corral_daemon::output::{emit, field_table, table};
use corral_daemon::{human_bytes, percent_bar};
use corral_proto::engine_generation::EngineGeneration;
use corral_proto::grpc::{self, GrpcTimeouts};
use corral_proto::v1::{
    self, replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use corral_proto::{Endpoint, ReplicaAddress};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use crate::model::ReplicaStatus;

/// What `--url` names: a replica address (`tcp://HOST:PORT?data=…&sync=…`, `docs/formats.md`), or only the
/// control endpoint (`HOST:PORT`, `tcp://HOST:PORT`, `unix:PATH`), whose sync endpoint is then asked from the
/// replica itself (`ReplicaResponse.sync_endpoint`). Returns the control endpoint and the sync endpoint if given.
pub fn parse_url(url: &str) -> anyhow::Result<(Endpoint, Option<Endpoint>)> {
    if url.contains('?') {
        let a: ReplicaAddress = url.parse()?;
        return Ok((a.control, Some(a.sync)));
    }
    let control = url
        .trim_start_matches("tcp://")
        .trim_start_matches("http://")
        .trim_end_matches('/');
    Ok((control.parse::<Endpoint>()?, None))
}

/// The sync endpoint a replica reported, reached on the control's host when it was bound to every interface.
pub fn reported_sync(control: &Endpoint, reported: &str) -> anyhow::Result<Endpoint> {
    let sync: Endpoint = reported
        .parse()
        .with_context(|| format!("the replica at {control} reported no usable sync endpoint"))?;
    Ok(match (sync, control.host()) {
        (Endpoint::Tcp { host, port }, Some(ch))
            if host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified()) =>
        {
            Endpoint::tcp(ch, port)
        }
        (sync, _) => sync,
    })
}

/// A channel whose every call presents an engine generation (none for 0): a replica that accepted one refuses a
/// call that changes it without it (`docs/formats.md`, "Engine generation"); the CLI's `--generation`.
pub type GenerationChannel = InterceptedService<Channel, EngineGeneration>;

/// Connects to a replica's `ReplicaService`; calls present `generation`.
pub async fn control(url: &str, generation: u64) -> anyhow::Result<ReplicaServiceClient<GenerationChannel>> {
    let (c, _) = parse_url(url)?;
    let ch = grpc::connect_endpoint(&c, GrpcTimeouts::OPERATOR)
        .await
        .context("replica")?;
    Ok(ReplicaServiceClient::with_interceptor(
        ch,
        EngineGeneration(generation),
    ))
}

/// Connects to a replica's `SyncAgentService`; calls present `generation`.
pub async fn sync_agent(
    url: &str,
    generation: u64,
) -> anyhow::Result<SyncAgentServiceClient<GenerationChannel>> {
    let sync = match parse_url(url)? {
        (_, Some(sync)) => sync,
        (c, None) => {
            let reported = control(url, 0)
                .await?
                .replica_get(v1::Empty {})
                .await?
                .into_inner()
                .sync_endpoint;
            reported_sync(&c, &reported)?
        }
    };
    let ch = grpc::connect_endpoint(&sync, GrpcTimeouts::OPERATOR)
        .await
        .context("replica sync agent")?;
    Ok(SyncAgentServiceClient::with_interceptor(
        ch,
        EngineGeneration(generation),
    ))
}

/// Prints an offline or online status as a table (or JSON).
pub fn print_status(s: &ReplicaStatus, json: bool) -> anyhow::Result<()> {
    if json {
        corral_daemon::output::print(true, s, String::new)?;
        return Ok(());
    }
    let rev = if s.revision_counter_disabled {
        "disabled".to_owned()
    } else {
        s.revision_counter.to_string()
    };
    let mut rows = vec![
        ("state", s.state.clone()),
        ("directory", s.dir.clone()),
        ("size", format!("{} ({})", human_bytes(s.size), s.size)),
        ("head", s.head.clone()),
        ("dirty / rebuilding", format!("{} / {}", s.dirty, s.rebuilding)),
        ("revision counter", rev),
        (
            "backing file",
            if s.backing_file.is_empty() {
                "-".to_owned()
            } else {
                s.backing_file.clone()
            },
        ),
    ];
    if !s.error.is_empty() {
        rows.push(("error", s.error.clone()));
    }
    emit(&field_table(rows).to_string());
    // The offline status and the gRPC answer print through one table: convert to the wire form.
    let r = crate::model::to_proto(s, "");
    print_disks(&r.chain, r.disks.values());
    Ok(())
}

fn print_disks<'a>(chain: &[String], disks: impl Iterator<Item = &'a v1::DiskInfo>) {
    let mut rows: Vec<&v1::DiskInfo> = disks.collect();
    // Live chain first (head first), then side branches by name.
    rows.sort_by_key(|d| {
        (
            chain.iter().position(|c| *c == d.name).unwrap_or(usize::MAX),
            d.name.clone(),
        )
    });
    let yes = |b: bool| if b { "yes" } else { "" }.to_owned();
    let t = table(
        &[
            "disk",
            "parent",
            "allocated",
            "live",
            "removed",
            "user",
            "created",
            "labels",
        ],
        rows.into_iter()
            .map(|d| {
                vec![
                    d.name.clone(),
                    if d.parent.is_empty() {
                        "-".into()
                    } else {
                        d.parent.clone()
                    },
                    human_bytes(d.size),
                    yes(chain.contains(&d.name)),
                    yes(d.removed),
                    yes(d.user_created),
                    d.created.clone(),
                    d.labels.len().to_string(),
                ]
            })
            .collect(),
    );
    emit(&t.to_string());
}

/// Prints a replica as returned by gRPC.
pub fn print_replica(r: &v1::Replica, json: bool) -> anyhow::Result<()> {
    if json {
        corral_daemon::output::print(true, r, String::new)?;
        return Ok(());
    }
    emit(&format!(
        "state {}  size {}  head {}  revision counter {}",
        r.state,
        human_bytes(r.size),
        r.head,
        if r.revision_counter_disabled {
            "disabled".into()
        } else {
            r.revision_counter.to_string()
        }
    ));
    print_disks(&r.chain, r.disks.values());
    Ok(())
}

/// Polls a job's status until it leaves `in-progress`, showing a progress bar on a terminal.
pub async fn wait_job<F, Fut>(what: &str, mut poll: F) -> anyhow::Result<(String, String)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(String, u32, String)>>,
{
    let bar = percent_bar(what);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(24 * 3600);
    loop {
        let (state, progress, error) = poll().await?;
        bar.set_position(u64::from(progress));
        if state != "in-progress" {
            bar.finish_and_clear();
            return Ok((state, error));
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{what}: still in progress after 24 h");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_is_a_replica_address_or_a_control_endpoint() {
        let (c, s) = parse_url("tcp://10.0.0.1:9502?data=9610&sync=9720").unwrap();
        assert_eq!(c, Endpoint::tcp("10.0.0.1", 9502));
        assert_eq!(s, Some(Endpoint::tcp("10.0.0.1", 9720)));
        for control in ["10.0.0.1:9502", "tcp://10.0.0.1:9502", "http://10.0.0.1:9502/"] {
            assert_eq!(
                parse_url(control).unwrap(),
                (Endpoint::tcp("10.0.0.1", 9502), None)
            );
        }
        assert!(parse_url("nohost").is_err());
        assert!(parse_url("tcp://10.0.0.1:9502?data=1").is_err());
    }

    #[test]
    fn a_wildcard_sync_listener_is_reached_on_the_control_host() {
        let c = Endpoint::tcp("10.0.0.1", 9502);
        assert_eq!(
            reported_sync(&c, "0.0.0.0:7000").unwrap(),
            Endpoint::tcp("10.0.0.1", 7000)
        );
        assert_eq!(
            reported_sync(&c, "[::]:7000").unwrap(),
            Endpoint::tcp("10.0.0.1", 7000)
        );
        assert_eq!(
            reported_sync(&c, "10.0.0.2:7000").unwrap(),
            Endpoint::tcp("10.0.0.2", 7000)
        );
        assert!(reported_sync(&c, "").is_err());
    }
}
