//! Keeping a node's TLS directory issued by the cluster CA: what a manager checks at every start.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{ServerName, UnixTime};
use time::OffsetDateTime;

use crate::ca::{ClusterCa, LeafRequest, SubjectAltName};
use crate::dir::{self, CA_CERT, CERT};
use crate::{TlsDir, TlsError};

impl ClusterCa {
    /// Why the node certificate in `dir` must be issued anew for `req`, or `None` to keep it: a file missing or
    /// unloadable, a `ca.crt` that is not this CA's, a certificate this CA did not sign, one that does not name
    /// every one of `req.sans`, or one within a third of its validity of expiry at `now`.
    pub fn renewal_reason(&self, dir: &Path, req: &LeafRequest, now: OffsetDateTime) -> Option<String> {
        if let Err(e) = TlsDir::load(dir) {
            return Some(e.to_string());
        }
        match dir::read_text(&dir.join(CA_CERT)) {
            Ok(ca) if ca.trim() == self.cert_pem().trim() => {}
            Ok(_) => return Some(format!("{}: not the cluster CA", dir.join(CA_CERT).display())),
            Err(e) => return Some(e.to_string()),
        }
        let cert_path = dir.join(CERT);
        let pem = match dir::read_text(&cert_path) {
            Ok(p) => p,
            Err(e) => return Some(e.to_string()),
        };
        self.check_leaf(&cert_path, &pem, &req.sans, now).err()
    }

    /// Checks the leaf in `pem` against this CA for each name at `now`, and that it is not in the last third of
    /// its validity.
    fn check_leaf(
        &self,
        cert_path: &Path,
        pem: &str,
        sans: &[SubjectAltName],
        now: OffsetDateTime,
    ) -> Result<(), String> {
        let here = |reason: String| format!("{}: {reason}", cert_path.display());
        let chain = dir::parse_certs(cert_path, pem.as_bytes()).map_err(|e| e.to_string())?;
        let mut roots = RootCertStore::empty();
        for ca in
            dir::parse_certs(Path::new(CA_CERT), self.cert_pem().as_bytes()).map_err(|e| e.to_string())?
        {
            roots.add(ca).map_err(|e| here(e.to_string()))?;
        }
        let verifier = WebPkiServerVerifier::builder_with_provider(roots.into(), crate::provider())
            .build()
            .map_err(|e| here(e.to_string()))?;
        let at = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::try_from(now.unix_timestamp()).unwrap_or(0),
        ));
        for san in sans {
            let name = match san {
                SubjectAltName::Ip(ip) => ServerName::IpAddress((*ip).into()),
                SubjectAltName::Dns(d) => ServerName::try_from(d.clone()).map_err(|e| here(e.to_string()))?,
            };
            verifier
                .verify_server_cert(&chain[0], &chain[1..], &name, &[], at)
                .map_err(|e| here(format!("not valid for {name:?} under the cluster CA: {e}")))?;
        }
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).map_err(|e| here(e.to_string()))?;
        let (not_before, not_after) = (leaf.validity().not_before, leaf.validity().not_after);
        let lifetime = not_after.timestamp() - not_before.timestamp();
        if not_after.timestamp() - now.unix_timestamp() < lifetime / 3 {
            return Err(here(format!(
                "expires at {not_after}, within a third of its validity"
            )));
        }
        Ok(())
    }

    /// Makes `dir` (mode 0700) hold a node certificate of this CA for `req`, issuing one when
    /// [`renewal_reason`](Self::renewal_reason) gives a reason (returned; `None`: the one there is kept).
    pub fn ensure_node_dir(&self, dir: &Path, req: &LeafRequest) -> Result<Option<String>, TlsError> {
        dir::create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
            TlsError::Write {
                path: dir.to_owned(),
                source,
            }
        })?;
        let Some(reason) = self.renewal_reason(dir, req, OffsetDateTime::now_utc()) else {
            return Ok(None);
        };
        self.issue(req)?.write(dir)?;
        Ok(Some(reason))
    }
}
