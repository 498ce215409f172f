//! Crash safety: SIGKILL a real replica daemon in the middle of a stream of writes, flushes and snapshots, many
//! times. After each restart the replica must open, its metadata must be consistent (no leftovers, a valid
//! chain), and every write acknowledged before the last acknowledged flush must read back exactly.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Daemon, block_pattern};
use corral_proto::v1;
use rand_like::Rng;

/// Tiny deterministic RNG wrapper so the test needs no extra dependency.
mod rand_like {
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        pub fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }
}

const SIZE: u64 = 64 << 20;
const BLOCKS: u64 = SIZE / 4096;
const ROUNDS: u64 = 40;

#[derive(Default)]
struct Model {
    /// Block contents made durable by an acknowledged flush.
    durable: HashMap<u64, Vec<u8>>,
    /// Writes issued since the last acknowledged flush (acknowledged or not): either value may be on disk.
    pending: HashMap<u64, Vec<Vec<u8>>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_flushed_writes_survive_sigkill_during_writes_flushes_and_snapshots() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("replica");
    let mut model = Model::default();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut generation = 0u64;
    let mut snaps = 0u64;
    let (mut acked_writes, mut acked_flushes, mut acked_snaps) = (0u64, 0u64, 0u64);
    let mut daemon = Daemon::start(&dir, Some(SIZE), &[]);
    for round in 0..ROUNDS {
        let data = daemon.data().await;
        let mut control = daemon.control().await;
        // Kill after a random delay while the stream below runs.
        let delay = Duration::from_millis(30 + rng.below(250));
        let pid = daemon.pid();
        let killer = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        });
        loop {
            let op = rng.below(100);
            let result = if op < 80 {
                let block = rng.below(BLOCKS);
                generation += 1;
                let partial = rng.below(4) == 0;
                let mut content = model_block(&model, block);
                let (off, buf) = if partial {
                    let sector = rng.below(8) * 512;
                    let p = block_pattern(block, generation);
                    content[usize::try_from(sector).unwrap()..usize::try_from(sector).unwrap() + 512]
                        .copy_from_slice(&p[..512]);
                    (block * 4096 + sector, p[..512].to_vec())
                } else {
                    content = block_pattern(block, generation);
                    (block * 4096, content.clone())
                };
                model.pending.entry(block).or_default().push(content);
                data.write(off, &buf).await.map_err(|e| e.to_string())
            } else if op < 95 {
                let r = data.flush().await.map_err(|e| e.to_string());
                if r.is_ok() {
                    for (b, mut versions) in model.pending.drain() {
                        model.durable.insert(b, versions.pop().unwrap());
                    }
                }
                r
            } else {
                snaps += 1;
                control
                    .replica_snapshot(v1::ReplicaSnapshotRequest {
                        name: format!("r{round}-s{snaps}"),
                        user_created: true,
                        ..Default::default()
                    })
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            };
            if result.is_err() {
                break; // the daemon is dead
            }
            match op {
                0..80 => acked_writes += 1,
                80..95 => acked_flushes += 1,
                _ => acked_snaps += 1,
            }
        }
        killer.await.unwrap();
        daemon.kill(); // reap what the killer left

        // Restart over the same directory and check.
        daemon = Daemon::start(&dir, None, &[]);
        let data = daemon.data().await;
        let status = daemon
            .control()
            .await
            .replica_get(v1::Empty {})
            .await
            .unwrap()
            .into_inner()
            .replica
            .unwrap();
        assert_eq!(status.state, "open", "round {round}");
        assert_eq!(status.size, SIZE);
        let layout = replica::layout::DirLayout::load(&dir).unwrap().unwrap();
        assert!(
            layout.repairs.is_empty(),
            "round {round}: leftovers after open: {:?}",
            layout.repairs
        );
        assert_eq!(layout.live.len(), status.chain.len(), "round {round}");

        let mut buf = vec![0u8; 4096];
        let touched: Vec<u64> = model
            .durable
            .keys()
            .chain(model.pending.keys())
            .copied()
            .collect();
        for block in touched {
            data.read(block * 4096, &mut buf).await.unwrap();
            let durable = model
                .durable
                .get(&block)
                .cloned()
                .unwrap_or_else(|| vec![0u8; 4096]);
            let ok = buf == durable || model.pending.get(&block).is_some_and(|vs| vs.contains(&buf));
            assert!(
                ok,
                "round {round}: block {block} holds neither its flushed content nor a later write"
            );
            // Whatever survived is now the truth for the next round.
            model.durable.insert(block, buf.clone());
        }
        model.pending.clear();
        // Make the adopted state durable before the next kill.
        data.flush().await.unwrap();
    }
    eprintln!(
        "{ROUNDS} kills; acknowledged: {acked_writes} writes, {acked_flushes} flushes, {acked_snaps} snapshots"
    );
    assert!(
        acked_writes > ROUNDS * 20 && acked_flushes > ROUNDS && acked_snaps > 0,
        "the stream barely ran"
    );
    assert!(daemon.terminate(), "SIGTERM must exit cleanly");
    let info = replica::inspect(&dir).unwrap();
    assert!(!info.dirty, "clean shutdown must clear Dirty");
}

fn model_block(m: &Model, block: u64) -> Vec<u8> {
    m.pending
        .get(&block)
        .and_then(|v| v.last().cloned())
        .or_else(|| m.durable.get(&block).cloned())
        .unwrap_or_else(|| vec![0u8; 4096])
}
