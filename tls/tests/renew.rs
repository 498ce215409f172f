//! A manager keeps its node's directory issued by the cluster CA (`ClusterCa::ensure_node_dir`): what it keeps and
//! what it issues anew, on real certificates.

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use corral_tls::{CERT, ClusterCa, KEY, LeafRequest, SubjectAltName};
use time::{Duration, OffsetDateTime};

fn sans() -> Vec<SubjectAltName> {
    vec![
        SubjectAltName::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        SubjectAltName::Dns("node-1".to_owned()),
    ]
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn a_missing_directory_is_issued_then_kept() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tls");
    let ca = ClusterCa::generate("cluster", 30).unwrap();
    let req = LeafRequest::new("node-1", sans(), 30);
    let why = ca.ensure_node_dir(&dir, &req).unwrap().expect("issued");
    assert!(why.contains("cannot read"), "{why}");
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(KEY)), 0o600);
    let cert = std::fs::read(dir.join(CERT)).unwrap();
    assert_eq!(ca.ensure_node_dir(&dir, &req).unwrap(), None);
    assert_eq!(
        std::fs::read(dir.join(CERT)).unwrap(),
        cert,
        "a good certificate is kept"
    );
}

#[test]
fn another_cas_certificate_or_a_missing_name_is_issued_anew() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tls");
    let ca = ClusterCa::generate("cluster", 30).unwrap();
    let stranger = ClusterCa::generate("cluster", 30).unwrap();
    let req = LeafRequest::new("node-1", sans(), 30);
    stranger.issue(&req).unwrap().write(&dir).unwrap();
    let why = ca
        .renewal_reason(&dir, &req, OffsetDateTime::now_utc())
        .expect("another CA's");
    assert!(why.contains("not the cluster CA"), "{why}");
    // Same CA file, leaf of the stranger: the signature check catches it.
    std::fs::write(dir.join("ca.crt"), ca.cert_pem()).unwrap();
    let why = ca
        .renewal_reason(&dir, &req, OffsetDateTime::now_utc())
        .expect("not signed by it");
    assert!(why.contains("not valid for"), "{why}");
    ca.ensure_node_dir(&dir, &req).unwrap().expect("issued");
    let mut more = sans();
    more.push(SubjectAltName::Ip("10.9.8.7".parse().unwrap()));
    let moved = LeafRequest::new("node-1", more, 30);
    let why = ca
        .renewal_reason(&dir, &moved, OffsetDateTime::now_utc())
        .expect("a new address");
    assert!(why.contains("10.9.8.7"), "{why}");
}

#[test]
fn a_certificate_in_the_last_third_of_its_validity_is_renewed() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tls");
    let ca = ClusterCa::generate("cluster", 3650).unwrap();
    let now = OffsetDateTime::now_utc();
    let mut old = LeafRequest::new("node-1", sans(), 30);
    old.not_before = now - Duration::days(25);
    old.not_after = now + Duration::days(5);
    ca.issue(&old).unwrap().write(&dir).unwrap();
    let why = ca.renewal_reason(&dir, &old, now).expect("near expiry");
    assert!(why.contains("within a third of its validity"), "{why}");
    old.not_before = now - Duration::days(15);
    old.not_after = now + Duration::days(15);
    ca.issue(&old).unwrap().write(&dir).unwrap();
    assert_eq!(ca.renewal_reason(&dir, &old, now), None, "half its validity left");
    let fresh = LeafRequest::new("node-1", sans(), 30);
    let why = ca.ensure_node_dir(&dir, &fresh).unwrap();
    assert_eq!(why, None);
    // Three weeks on, 9 of 30 left: issued anew, and then a full validity again.
    let later = now + Duration::days(21);
    assert!(ca.renewal_reason(&dir, &fresh, later).is_some());
}
