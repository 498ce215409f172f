//! The one way an HTTP client of a Corral endpoint (a sync receiver, `corral-bim`'s download, a data source) is
//! built: the URL scheme follows the TLS config, and reqwest gets the node's rustls client config as it is (the
//! `ring` provider, the cluster CA as the only root, the node's certificate shown to the server). reqwest is
//! built with `rustls-no-provider`, so a client built without going through [`reqwest_tls`] panics in a process
//! where no other crate compiled in reqwest's own provider: build every client of a Corral endpoint here.

use corral_tls::rustls::{self, ClientConfig};

/// The base URL of an HTTP endpoint at `address` (`HOST:PORT` or a URL, no trailing `/`): `https://` when `tls`,
/// else the scheme given, else `http://`. With TLS a plaintext URL is upgraded rather than refused: the peer
/// would refuse it anyway, and every address Corral passes around is a `HOST:PORT`.
pub fn http_base(address: &str, tls: bool) -> String {
    let address = address.trim_end_matches('/');
    let bare = address
        .strip_prefix("https://")
        .or_else(|| address.strip_prefix("http://"));
    match bare {
        _ if tls => format!("https://{}", bare.unwrap_or(address)),
        Some(_) => address.to_string(),
        None => format!("http://{address}"),
    }
}

/// `builder` with `tls` as its only TLS setup. The config's ALPN list is cleared: reqwest then speaks HTTP/1.1,
/// which every Corral HTTP server serves, whatever protocols the shared config offers for gRPC. Without a config
/// the client is for plaintext endpoints: it gets a config on the `ring` provider that trusts no CA (reqwest's
/// own default would need a process-wide provider, which Corral never installs), so an `https://` URL fails.
pub fn reqwest_tls(builder: reqwest::ClientBuilder, tls: Option<&ClientConfig>) -> reqwest::ClientBuilder {
    let mut config = match tls {
        Some(config) => config.clone(),
        None => ClientConfig::builder_with_provider(corral_tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("ring supports TLS 1.3")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    };
    config.alpn_protocols.clear();
    builder.tls_backend_preconfigured(config)
}

#[cfg(test)]
mod tests {
    use super::http_base;

    #[test]
    fn the_scheme_follows_the_tls_config() {
        assert_eq!(http_base("10.0.0.5:7000", false), "http://10.0.0.5:7000");
        assert_eq!(http_base("10.0.0.5:7000", true), "https://10.0.0.5:7000");
        assert_eq!(http_base("http://node-1:7000/", true), "https://node-1:7000");
        assert_eq!(http_base("https://node-1:7000", true), "https://node-1:7000");
        assert_eq!(http_base("http://node-1:7000/", false), "http://node-1:7000");
        assert_eq!(http_base("[fd00::5]:7000", true), "https://[fd00::5]:7000");
    }
}
