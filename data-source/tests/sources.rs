//! The other source types (clone, export-from-volume; restore is in `restore.rs`), the v2 engine's qcow2 → raw conversion, and bad
//! input refused at start with nothing on disk changed.

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use common::*;
use corral_proto::v1;
use data_source::FileState;
use tonic::codegen::{BoxFuture, Service, http};

const MIB: u64 = 1 << 20;

/// A listing of every file under `dir` with its size and checksum, to show nothing changed.
fn snapshot_dir(dir: &Path) -> Vec<(PathBuf, u64, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.push((p.clone(), 0, String::new()));
                stack.push(p);
            } else {
                let len = std::fs::metadata(&p).unwrap().len();
                out.push((p.clone(), len, sha512_file(&p)));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn bad_input_is_refused_at_start_and_nothing_on_disk_changes() {
    let disk = disk();
    // A leftover the refused starts must not clean up either.
    std::fs::create_dir_all(disk.path().join("tmp")).unwrap();
    std::fs::write(disk.path().join("tmp/img-u1.tmp"), b"old").unwrap();
    let before = snapshot_dir(disk.path());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--name", "../../etc"], "name"),
        (vec!["--name", "a/b"], "name"),
        (vec!["--uuid", ".."], "uuid"),
        (vec!["--source-type", "ftp"], "unknown source type"),
        (vec!["--source-type", "download"], "url"),
        (
            vec!["--source-type", "download", "--param", "url=file:///etc/passwd"],
            "scheme",
        ),
        (
            vec!["--source-type", "clone", "--param", "backing-image=x"],
            "backing-image-uuid",
        ),
        (
            vec![
                "--source-type",
                "clone",
                "--param",
                "backing-image=../x",
                "--param",
                "backing-image-uuid=u",
            ],
            "backing-image",
        ),
        (
            vec![
                "--source-type",
                "export-from-volume",
                "--param",
                "snapshot-name=s",
            ],
            "sender-address",
        ),
        (vec!["--source-type", "restore"], "backup-url"),
        (
            vec![
                "--source-type",
                "restore",
                "--param",
                "backup-url=file:///srv/backups?volume=v",
            ],
            "missing backup=NAME",
        ),
        (
            vec![
                "--source-type",
                "restore",
                "--param",
                "backup-url=ftp://h/x?backup=b&volume=v",
            ],
            "unsupported scheme",
        ),
        (vec!["--param", "novalue"], "KEY=VALUE"),
        (vec!["--expected-checksum", "abc"], "SHA-512"),
        (vec!["--disk-uuid", "another-disk"], "another-disk"),
        (vec!["--data-engine", "v3"], "v3"),
    ];
    for (overrides, want) in cases {
        let mut args = vec![
            "serve".to_owned(),
            "--listen".into(),
            "127.0.0.1:0".to_owned(),
            "--disk-path".into(),
            disk.path().display().to_string(),
        ];
        let mut named: std::collections::BTreeMap<&str, &str> = [
            ("--disk-uuid", DISK_UUID),
            ("--name", "img"),
            ("--uuid", "u1"),
            ("--source-type", "upload"),
        ]
        .into();
        let mut extra = Vec::new();
        let mut it = overrides.iter();
        while let Some(k) = it.next() {
            let v = it.next().unwrap();
            if named.contains_key(k) {
                named.insert(k, v);
            } else {
                extra.push((*k).to_owned());
                extra.push((*v).to_owned());
            }
        }
        for (k, v) in named {
            args.push(k.to_owned());
            args.push(v.to_owned());
        }
        args.extend(extra);
        let out = Command::new(bin())
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{overrides:?} accepted");
        assert!(
            stderr.contains(want),
            "{overrides:?}: stderr lacks {want:?}:\n{stderr}"
        );
        assert_eq!(
            snapshot_dir(disk.path()),
            before,
            "{overrides:?} changed the disk"
        );
    }
}

#[test]
fn clone_copies_another_image_on_the_disk_sparsely() {
    let disk = disk();
    let dir = disk.path().join("backing-images/base-b1");
    std::fs::create_dir_all(&dir).unwrap();
    let data = raw_image(&dir.join("backing"), 16 * MIB);
    let sum = sha512(&data);
    let ds = DataSourceProc::start(
        disk.path(),
        "clone",
        &[
            "--param",
            "backing-image=base",
            "--param",
            "backing-image-uuid=b1",
            "--expected-checksum",
            &sum,
        ],
    );
    let i = ds.expect_ready(&sum);
    assert_eq!(i.size, 16 * MIB);
    assert!(
        i.real_size <= allocated(&dir.join("backing")),
        "the copy is not sparse: {}",
        i.real_size
    );
    assert!(dir.join("backing").exists(), "the source stays");

    let disk2 = common::disk();
    let ds = DataSourceProc::start(
        disk2.path(),
        "clone",
        &[
            "--param",
            "backing-image=missing",
            "--param",
            "backing-image-uuid=b1",
        ],
    );
    let i = ds.wait_final(Duration::from_secs(20));
    assert_eq!(i.state, FileState::Failed);
    assert!(
        i.message.contains("backing-images/missing-b1/backing"),
        "{}",
        i.message
    );
}

#[test]
fn v2_engine_converts_a_qcow2_download_to_the_raw_qemu_img_makes() {
    let src = tempfile::tempdir_in("/var/tmp").unwrap();
    let q = qcow2_image(src.path(), 24 * MIB);
    let qpath = src.path().join("src.qcow2");
    let reference = src.path().join("ref.raw");
    qemu_img(&["convert", "-f", "qcow2", "-O", "raw"], &[&qpath, &reference]);
    let want = sha512_file(&reference);
    let server = FileServer::start(q.clone(), ServeMode::range());
    // The expected checksum names the qcow2 as the user has it; the stored raw file has another.
    let disk = disk();
    let ds = DataSourceProc::download(
        disk.path(),
        &server.url,
        &["--data-engine", "v2", "--expected-checksum", &sha512(&q)],
    );
    let i = ds.expect_ready(&want);
    assert_eq!((i.size, i.virtual_size), (24 * MIB, 24 * MIB));
    assert!(i.message.contains("converted qcow2 to raw"), "{}", i.message);
    qemu_img(
        &["compare", "-f", "raw", "-F", "raw"],
        &[Path::new(&i.file_path), &reference],
    );
}

// --- export-from-volume against a stand-in replica sync agent whose VolumeExport runs `corral-sync send`'s
// sender (`sparse_sync::send`) on a file. Only VolumeExport is served; the reply is empty, which decodes as the
// default of any response message.

#[derive(Clone)]
struct ExportStandIn {
    file: PathBuf,
    calls: Arc<AtomicU64>,
}

impl tonic::server::NamedService for ExportStandIn {
    const NAME: &'static str = "corral.v1.SyncAgentService";
}

struct VolumeExport(ExportStandIn);

impl tonic::server::UnaryService<v1::VolumeExportRequest> for VolumeExport {
    type Response = v1::Empty;
    type Future = BoxFuture<tonic::Response<v1::Empty>, tonic::Status>;

    fn call(&mut self, req: tonic::Request<v1::VolumeExportRequest>) -> Self::Future {
        let s = self.0.clone();
        Box::pin(async move {
            s.calls.fetch_add(1, Ordering::Relaxed);
            let r = req.into_inner();
            assert!(r.export_backing_image_if_exist);
            assert_eq!(r.snapshot_file_name, "snap1");
            let content =
                corral_disk::sparse::FileContent::open(&s.file, corral_disk::sparse::LayoutMode::SeekData)
                    .unwrap();
            sparse_sync::send(
                Arc::new(content),
                &format!("{}:{}", r.host, r.port),
                &sparse_sync::SendOptions::default(),
                &sparse_sync::Progress::new(),
                &sparse_sync::CancellationToken::new(),
            )
            .await
            .map_err(|e| tonic::Status::failed_precondition(e.to_string()))?;
            Ok(tonic::Response::new(v1::Empty {}))
        })
    }
}

impl Service<http::Request<tonic::body::Body>> for ExportStandIn {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let s = self.clone();
        Box::pin(async move {
            if req.uri().path() == "/corral.v1.SyncAgentService/VolumeExport" {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(VolumeExport(s), req).await)
            } else {
                Ok(tonic::Status::unimplemented("stand-in").into_http())
            }
        })
    }
}

/// Serves the stand-in on a free port; returns its address and the call counter.
fn start_stand_in(file: PathBuf) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let svc = ExportStandIn {
        file,
        calls: calls.clone(),
    };
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await;
        });
    });
    (addr, calls)
}

#[test]
fn export_from_volume_receives_the_snapshot_as_raw_and_as_qcow2() {
    let src = tempfile::tempdir_in("/var/tmp").unwrap();
    let snap = src.path().join("flattened.img");
    let data = raw_image(&snap, 16 * MIB);
    let (addr, calls) = start_stand_in(snap.clone());
    let params = |ft: &str| {
        vec![
            "--param".to_owned(),
            "snapshot-name=snap1".into(),
            "--param".into(),
            format!("sender-address={addr}"),
            "--param".into(),
            "volume-size=16M".into(),
            "--param".into(),
            format!("file-type={ft}"),
        ]
    };

    let disk = disk();
    let args = params("raw");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ds = DataSourceProc::start(disk.path(), "export-from-volume", &args);
    let i = ds.expect_ready(&sha512(&data));
    assert_eq!(i.size, 16 * MIB);
    assert!(
        i.real_size <= allocated(&snap),
        "holes were written: {}",
        i.real_size
    );
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    drop(ds);

    let disk = common::disk();
    let args = params("qcow2");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ds = DataSourceProc::start(disk.path(), "export-from-volume", &args);
    let i = ds.wait_final(Duration::from_secs(60));
    assert_eq!(i.state, FileState::ReadyForTransfer, "{i:?}");
    assert_eq!(i.virtual_size, 16 * MIB);
    assert!(i.message.contains("converted raw to qcow2"), "{}", i.message);
    // The qcow2 file holds the snapshot.
    qemu_img(
        &["compare", "-f", "qcow2", "-F", "raw"],
        &[Path::new(&i.file_path), &snap],
    );

    // A sender that does not answer fails the job with its address in the message.
    let disk = common::disk();
    let dead = testkit::ports::RefusedAddr::new();
    let ds = DataSourceProc::start(
        disk.path(),
        "export-from-volume",
        &[
            "--param",
            "snapshot-name=snap1",
            "--param",
            &format!("sender-address={}", dead.addr),
            "--param",
            "volume-size=16M",
        ],
    );
    let i = ds.wait_final(Duration::from_secs(40));
    assert_eq!(i.state, FileState::Failed);
    assert!(i.message.contains(&dead.addr.to_string()), "{}", i.message);
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}
