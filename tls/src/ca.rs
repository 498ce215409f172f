//! The cluster CA and the node certificates it issues.

use std::net::IpAddr;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType, SerialNumber,
};
use time::{Duration, OffsetDateTime};

use crate::dir::{self, CA_CERT, CA_KEY, CERT, KEY, Mode};
use crate::error::TlsError;

/// Default validity of a cluster CA, in days (10 years: rotation is an explicit operator action).
pub const CA_DAYS: u32 = 3650;
/// Default validity of a node certificate, in days.
pub const LEAF_DAYS: u32 = 365;

/// How far back a new certificate's validity starts, so a peer whose clock is a little behind accepts it.
const CLOCK_SKEW: Duration = Duration::minutes(5);

/// A cluster CA: its certificate and the key that signs node certificates.
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

/// One subject alternative name of a node certificate: what a peer dials the node by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectAltName {
    Dns(String),
    Ip(IpAddr),
}

impl std::str::FromStr for SubjectAltName {
    type Err = TlsError;

    /// An IP address, else a DNS name (checked when the certificate is issued).
    fn from_str(s: &str) -> Result<Self, TlsError> {
        Ok(match s.parse::<IpAddr>() {
            Ok(ip) => Self::Ip(ip),
            Err(_) => Self::Dns(s.to_owned()),
        })
    }
}

/// What a node certificate says: its name, the names peers reach it by, and when it is valid.
#[derive(Debug, Clone)]
pub struct LeafRequest {
    /// The certificate's common name (the node or daemon, for logs; peers check the SANs, not this).
    pub name: String,
    pub sans: Vec<SubjectAltName>,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl LeafRequest {
    /// A request valid from a few minutes ago for `days` days.
    pub fn new(name: impl Into<String>, sans: Vec<SubjectAltName>, days: u32) -> Self {
        let now = OffsetDateTime::now_utc();
        Self {
            name: name.into(),
            sans,
            not_before: now - CLOCK_SKEW,
            not_after: now + Duration::days(i64::from(days)),
        }
    }
}

/// A node certificate and its key, in PEM, with the CA certificate that issued it.
pub struct NodeCert {
    pub ca_pem: String,
    pub cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for NodeCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCert").finish_non_exhaustive()
    }
}

impl NodeCert {
    /// The private key in PEM (PKCS#8). Only for writing it where it belongs.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Writes `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into `dir` (created if missing), each crash-safely:
    /// a file is the old content or the new, never a mix.
    pub fn write(&self, dir: &Path) -> Result<(), TlsError> {
        dir::create(dir)?;
        dir::write(&dir.join(CA_CERT), self.ca_pem.as_bytes(), Mode::Public)?;
        dir::write(&dir.join(KEY), self.key_pem.as_bytes(), Mode::Secret)?;
        dir::write(&dir.join(CERT), self.cert_pem.as_bytes(), Mode::Public)
    }
}

impl ClusterCa {
    /// A new CA named `common_name`, valid for `days` days.
    pub fn generate(common_name: &str, days: u32) -> Result<Self, TlsError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + Duration::days(i64::from(days));
        params.serial_number = Some(random_serial()?);
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate in PEM (what every node trusts).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes `ca.crt` and `ca.key` (mode 0600) into `dir` (created if missing). Refuses to replace a CA
    /// already there.
    pub fn write(&self, dir: &Path) -> Result<(), TlsError> {
        dir::create(dir)?;
        let key_path = dir.join(CA_KEY);
        if key_path.exists() {
            return Err(TlsError::CaExists { path: key_path });
        }
        dir::write(&dir.join(CA_CERT), self.cert_pem.as_bytes(), Mode::Public)?;
        dir::write(&key_path, self.key_pem.as_bytes(), Mode::Secret)
    }

    /// Loads the CA that [`write`](Self::write) wrote into `dir`, checking that the key is the certificate's.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        let cert_pem = dir::read_text(&cert_path)?;
        let key_pem = dir::read_text(&key_path)?;
        Self::from_pem_at(cert_pem, key_pem, &cert_path, &key_path)
    }

    /// A CA from its certificate and key PEM kept elsewhere (the manager's store); `origin` names where, in
    /// errors (never the key's content).
    pub fn from_pem(cert_pem: String, key_pem: String, origin: &str) -> Result<Self, TlsError> {
        let origin = Path::new(origin);
        Self::from_pem_at(cert_pem, key_pem, &origin.join(CA_CERT), &origin.join(CA_KEY))
    }

    fn from_pem_at(
        cert_pem: String,
        key_pem: String,
        cert_path: &Path,
        key_path: &Path,
    ) -> Result<Self, TlsError> {
        let ca = dir::parse_certs(cert_path, cert_pem.as_bytes())?;
        let key_der = dir::parse_key(key_path, key_pem.as_bytes())?;
        dir::check_key_matches(ca, key_der, cert_path, key_path)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| TlsError::Unusable {
            path: key_path.to_owned(),
            reason: format!("not an ECDSA P-256 key rcgen can sign with: {e}"),
        })?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| TlsError::Unusable {
            path: cert_path.to_owned(),
            reason: format!("not a CA certificate: {e}"),
        })?;
        Ok(Self {
            cert_pem,
            key_pem,
            issuer,
        })
    }

    /// The CA's private key in PEM (PKCS#8). Only for storing it where it belongs.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues a node certificate (server and client authentication) with a fresh ECDSA P-256 key.
    pub fn issue(&self, req: &LeafRequest) -> Result<NodeCert, TlsError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, req.name.as_str());
        params.subject_alt_names = req.sans.iter().map(san).collect::<Result<_, _>>()?;
        // keyEncipherment means nothing for an ECDSA key, but QEMU (`tls-creds-x509`, an NBD client or server)
        // refuses a certificate whose critical key usage lacks it.
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = req.not_before;
        params.not_after = req.not_after;
        params.serial_number = Some(random_serial()?);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(NodeCert {
            ca_pem: self.cert_pem.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

fn san(name: &SubjectAltName) -> Result<SanType, TlsError> {
    Ok(match name {
        SubjectAltName::Ip(ip) => SanType::IpAddress(*ip),
        SubjectAltName::Dns(dns) => {
            // rcgen takes any IA5 string; a peer's verifier would refuse a malformed one at every handshake.
            rustls::pki_types::DnsName::try_from(dns.as_str()).map_err(|e| TlsError::BadName {
                name: dns.clone(),
                reason: e.to_string(),
            })?;
            SanType::DnsName(
                dns.clone()
                    .try_into()
                    .map_err(|e: rcgen::Error| TlsError::BadName {
                        name: dns.clone(),
                        reason: e.to_string(),
                    })?,
            )
        }
    })
}

/// A random positive 16-byte serial number (RFC 5280: unique per CA, at most 20 bytes).
fn random_serial() -> Result<SerialNumber, TlsError> {
    let mut bytes = [0u8; 16];
    crate::provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| TlsError::Random)?;
    bytes[0] &= 0x7f;
    Ok(SerialNumber::from_slice(&bytes))
}
