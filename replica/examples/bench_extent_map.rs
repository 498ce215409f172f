//! Memory of the location map alone: one million scattered 4 KiB runs over 1 TiB spread across 500 layers (the
//! shape of `bench_large_chain` without building files). Prints bytes per run from the process's RSS growth.
//!
//! `cargo run --release -p replica --example bench_extent_map [RUNS]`

use replica::extent_map::ExtentMap;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let runs: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let blocks: u64 = (1 << 40) / 4096;
    let before = rss_kib();
    let mut map = ExtentMap::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..runs {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x % blocks;
        map.set(b, b + 1, u32::try_from(i % 500).unwrap_or(0));
    }
    let after = rss_kib();
    let n = map.run_count() as u64;
    println!(
        "runs inserted {runs}, runs held {n}, RSS growth {} KiB, {:.1} bytes/run",
        after - before,
        (after - before) as f64 * 1024.0 / n.max(1) as f64
    );
}
