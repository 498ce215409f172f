//! Fixed newstyle negotiation: from the server greeting to the start of the transmission phase.
//!
//! [`negotiate`] drives one connection's handshake over any byte stream. Option errors that the protocol can
//! express (unknown option, wrong export name, malformed payload) are answered with `NBD_REP_ERR_*` and the
//! negotiation goes on; violations it cannot express (bad magic, option payload over 64 KiB, unknown client
//! flags, an unknown name with NBD_OPT_EXPORT_NAME, truncated input) end it with a [`HandshakeError`], and
//! the caller closes the connection.
//!
//! On a TLS-only listener the caller starts with [`greet`] in [`Tls::Required`] and calls [`negotiate_options`]
//! until the client sends NBD_OPT_STARTTLS; it then runs the TLS handshake on the socket and calls
//! [`negotiate_options`] again inside the session (no second greeting, as the protocol says).

use std::io;

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::wire::{
    self, BASE_ALLOCATION, BASE_ALLOCATION_ID, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, FLAG_FIXED_NEWSTYLE,
    FLAG_NO_ZEROES, IHAVEOPT, NBD_MAGIC, OPTION_HEADER_LEN, OptionHeader, WireError, be_u16, be_u32, info,
    opt, rep,
};

/// Options a client may send before the server gives up on it (each is answered, so a loop is a broken
/// client).
const MAX_OPTIONS: usize = 1024;

/// What the handshake tells the client about the export.
#[derive(Debug, Clone)]
pub struct ExportInfo {
    /// Export name; the empty name selects it too.
    pub name: String,
    /// Human-readable description (NBD_INFO_DESCRIPTION); empty to omit.
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// NBD_FLAG_* transmission flags.
    pub transmission_flags: u16,
    /// Minimum block size (NBD_INFO_BLOCK_SIZE).
    pub min_block: u32,
    /// Preferred block size.
    pub preferred_block: u32,
    /// Maximum payload size.
    pub max_block: u32,
}

/// What the client and server agreed on for the transmission phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Negotiated {
    /// Structured replies (NBD_OPT_STRUCTURED_REPLY) are in use.
    pub structured_replies: bool,
    /// `base:allocation` was selected with NBD_OPT_SET_META_CONTEXT, so BLOCK_STATUS is allowed.
    pub base_allocation: bool,
}

/// Where a connection stands with TLS (NBD_OPT_STARTTLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    /// The listener offers no TLS (a unix socket, or a server without a TLS config): STARTTLS is refused with
    /// `NBD_REP_ERR_POLICY` and every other option is served.
    Off,
    /// TLS is mandatory and not started yet: STARTTLS and ABORT are served, every other option is answered
    /// `NBD_REP_ERR_TLS_REQD` (NBD_OPT_EXPORT_NAME, which has no error reply, closes the connection).
    Required,
    /// Inside the TLS session: every option is served; a second STARTTLS is `NBD_REP_ERR_INVALID`.
    Active,
}

/// One connection's negotiation state, kept by the caller across [`negotiate_options`] calls (before and after
/// STARTTLS) and readable even when the negotiation failed.
#[derive(Debug, Clone, Copy)]
pub struct Negotiation {
    /// What the options agreed so far.
    pub negotiated: Negotiated,
    /// The TLS state; the caller moves it from [`Tls::Required`] to [`Tls::Active`] with [`Self::start_tls`].
    pub tls: Tls,
    /// Options refused because TLS was required and not started (a plaintext client, for the log).
    pub refused_without_tls: u32,
    no_zeroes: bool,
}

impl Negotiation {
    /// The TLS session is up: negotiation restarts inside it, forgetting whatever was agreed in plaintext.
    pub fn start_tls(&mut self) {
        self.negotiated = Negotiated::default();
        self.tls = Tls::Active;
    }
}

/// How a handshake that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeOutcome {
    /// The client selected the export; transmission starts.
    Transmission(Negotiated),
    /// The client sent NBD_OPT_ABORT (e.g. `nbdinfo --list`).
    Aborted,
    /// NBD_OPT_STARTTLS was acknowledged: the caller runs the TLS handshake on the stream, calls
    /// [`Negotiation::start_tls`] and [`negotiate_options`] again over the TLS session.
    StartTls,
}

/// A handshake that cannot continue; the connection is closed.
#[derive(Debug, Error)]
pub enum HandshakeError {
    /// Socket error or the client hung up mid-message.
    #[error("handshake io: {0}")]
    Io(#[from] io::Error),
    /// Malformed option framing.
    #[error("malformed option: {0}")]
    Wire(#[from] WireError),
    /// The client set flags this server does not know.
    #[error("unknown client flags {0:#x}")]
    ClientFlags(u32),
    /// NBD_OPT_EXPORT_NAME asked for an export that does not exist (this option has no error reply).
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    /// NBD_OPT_EXPORT_NAME before STARTTLS on a TLS-only listener (this option has no error reply).
    #[error("client sent NBD_OPT_EXPORT_NAME without TLS; this server requires TLS (NBD_OPT_STARTTLS)")]
    TlsRequired,
    /// Refused on a TLS-only listener: the client negotiated without TLS, or its TLS handshake failed. The
    /// caller has logged it (once per peer address).
    #[error("refused: {0}")]
    Refused(io::Error),
    /// The client kept sending options.
    #[error("more than {MAX_OPTIONS} options")]
    TooManyOptions,
}

/// Runs the server side of the fixed newstyle handshake on `stream`, on a listener that offers no TLS.
pub async fn negotiate<S>(stream: &mut S, export: &ExportInfo) -> Result<HandshakeOutcome, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut n = greet(stream, Tls::Off).await?;
    negotiate_options(stream, export, &mut n).await
}

/// Sends the server greeting and reads the client's flags: the start of every handshake.
pub async fn greet<S>(stream: &mut S, tls: Tls) -> Result<Negotiation, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut greeting = [0u8; 18];
    greeting[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    greeting[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    greeting[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting).await?;
    stream.flush().await?;

    let client_flags = stream.read_u32().await?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    Ok(Negotiation {
        negotiated: Negotiated::default(),
        tls,
        refused_without_tls: 0,
        no_zeroes: client_flags & FLAG_C_NO_ZEROES != 0,
    })
}

/// Answers the client's options until it selects the export, aborts or (with [`Tls::Required`]) starts TLS.
pub async fn negotiate_options<S>(
    stream: &mut S,
    export: &ExportInfo,
    n: &mut Negotiation,
) -> Result<HandshakeOutcome, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut payload = Vec::new();
    let mut out = Vec::with_capacity(256);
    for _ in 0..MAX_OPTIONS {
        let mut header = [0u8; OPTION_HEADER_LEN];
        stream.read_exact(&mut header).await?;
        let header = OptionHeader::parse(&header)?;
        payload.resize(header.len as usize, 0);
        stream.read_exact(&mut payload).await?;

        out.clear();
        let step = answer_option(header.option, &payload, export, n, &mut out);
        // ABORT's acknowledgement is a courtesy: the client may already be gone.
        let write = async {
            stream.write_all(&out).await?;
            stream.flush().await
        };
        match step {
            Step::Continue => write.await?,
            Step::Abort => {
                let _ = write.await;
                return Ok(HandshakeOutcome::Aborted);
            }
            Step::Transmit => {
                write.await?;
                return Ok(HandshakeOutcome::Transmission(n.negotiated));
            }
            Step::StartTls => {
                write.await?;
                return Ok(HandshakeOutcome::StartTls);
            }
            Step::UnknownExport(name) => return Err(HandshakeError::UnknownExport(name)),
            Step::TlsRequired => return Err(HandshakeError::TlsRequired),
        }
    }
    Err(HandshakeError::TooManyOptions)
}

enum Step {
    Continue,
    Abort,
    Transmit,
    StartTls,
    UnknownExport(String),
    TlsRequired,
}

/// Computes the server's answer to one option into `out`; pure, so the whole option parser is fuzzable.
fn answer_option(
    option: u32,
    payload: &[u8],
    export: &ExportInfo,
    n: &mut Negotiation,
    out: &mut Vec<u8>,
) -> Step {
    if n.tls == Tls::Required && !matches!(option, opt::STARTTLS | opt::ABORT) {
        n.refused_without_tls = n.refused_without_tls.saturating_add(1);
        if option == opt::EXPORT_NAME {
            return Step::TlsRequired;
        }
        put_error(
            out,
            option,
            rep::ERR_TLS_REQD,
            "TLS required: this server serves only clients with a certificate of the cluster CA (NBD_OPT_STARTTLS)",
        );
        return Step::Continue;
    }
    match option {
        opt::EXPORT_NAME => {
            let name = String::from_utf8_lossy(payload);
            if !name_matches(export, payload) {
                return Step::UnknownExport(name.into_owned());
            }
            out.extend_from_slice(&export.size.to_be_bytes());
            out.extend_from_slice(&export.transmission_flags.to_be_bytes());
            if !n.no_zeroes {
                out.extend_from_slice(&[0u8; 124]);
            }
            Step::Transmit
        }
        opt::ABORT => {
            put_reply(out, option, rep::ACK, &[]);
            Step::Abort
        }
        opt::LIST => {
            if !payload.is_empty() {
                put_error(out, option, rep::ERR_INVALID, "NBD_OPT_LIST takes no data");
            } else {
                let name = export.name.as_bytes();
                let mut data = Vec::with_capacity(4 + name.len());
                data.extend_from_slice(&len_u32(name.len()).to_be_bytes());
                data.extend_from_slice(name);
                put_reply(out, option, rep::SERVER, &data);
                put_reply(out, option, rep::ACK, &[]);
            }
            Step::Continue
        }
        opt::INFO | opt::GO => answer_info(option, payload, export, out),
        opt::STRUCTURED_REPLY => {
            if payload.is_empty() {
                n.negotiated.structured_replies = true;
                put_reply(out, option, rep::ACK, &[]);
            } else {
                put_error(
                    out,
                    option,
                    rep::ERR_INVALID,
                    "NBD_OPT_STRUCTURED_REPLY takes no data",
                );
            }
            Step::Continue
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
            answer_meta_context(option, payload, export, &mut n.negotiated, out);
            Step::Continue
        }
        opt::STARTTLS => answer_starttls(payload, n.tls, out),
        _ => {
            put_error(out, option, rep::ERR_UNSUP, "option not supported");
            Step::Continue
        }
    }
}

fn answer_starttls(payload: &[u8], tls: Tls, out: &mut Vec<u8>) -> Step {
    let option = opt::STARTTLS;
    match tls {
        Tls::Off => put_error(
            out,
            option,
            rep::ERR_POLICY,
            "TLS is not offered on this listener",
        ),
        Tls::Active => put_error(out, option, rep::ERR_INVALID, "TLS is already negotiated"),
        Tls::Required if !payload.is_empty() => {
            put_error(out, option, rep::ERR_INVALID, "NBD_OPT_STARTTLS takes no data");
        }
        Tls::Required => {
            put_reply(out, option, rep::ACK, &[]);
            return Step::StartTls;
        }
    }
    Step::Continue
}

/// NBD_OPT_INFO / NBD_OPT_GO: `u32 name length, name, u16 count, count × u16 info type`.
fn answer_info(option: u32, payload: &[u8], export: &ExportInfo, out: &mut Vec<u8>) -> Step {
    let mut r = Reader(payload);
    let parsed = (|| {
        let name_len = r.u32()?;
        let name = r.bytes(usize::try_from(name_len).ok()?)?;
        let count = r.u16()?;
        let requests = r.bytes(usize::from(count) * 2)?;
        r.0.is_empty().then_some((name, requests))
    })();
    let Some((name, requests)) = parsed else {
        put_error(out, option, rep::ERR_INVALID, "malformed NBD_OPT_INFO/GO payload");
        return Step::Continue;
    };
    if !name_matches(export, name) {
        put_error(out, option, rep::ERR_UNKNOWN, "no such export");
        return Step::Continue;
    }

    let mut item = Vec::with_capacity(16);
    item.extend_from_slice(&info::EXPORT.to_be_bytes());
    item.extend_from_slice(&export.size.to_be_bytes());
    item.extend_from_slice(&export.transmission_flags.to_be_bytes());
    put_reply(out, option, rep::INFO, &item);

    let wants = |kind: u16| requests.chunks_exact(2).any(|c| be_u16(c, 0) == kind);
    if wants(info::NAME) {
        item.clear();
        item.extend_from_slice(&info::NAME.to_be_bytes());
        item.extend_from_slice(export.name.as_bytes());
        put_reply(out, option, rep::INFO, &item);
    }
    if wants(info::DESCRIPTION) && !export.description.is_empty() {
        item.clear();
        item.extend_from_slice(&info::DESCRIPTION.to_be_bytes());
        item.extend_from_slice(export.description.as_bytes());
        put_reply(out, option, rep::INFO, &item);
    }
    // Always sent: the constraints hold whether or not the client asked.
    item.clear();
    item.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    item.extend_from_slice(&export.min_block.to_be_bytes());
    item.extend_from_slice(&export.preferred_block.to_be_bytes());
    item.extend_from_slice(&export.max_block.to_be_bytes());
    put_reply(out, option, rep::INFO, &item);
    put_reply(out, option, rep::ACK, &[]);
    if option == opt::GO {
        Step::Transmit
    } else {
        Step::Continue
    }
}

/// NBD_OPT_{LIST,SET}_META_CONTEXT: `u32 name length, name, u32 count, count × (u32 length, query)`.
fn answer_meta_context(
    option: u32,
    payload: &[u8],
    export: &ExportInfo,
    n: &mut Negotiated,
    out: &mut Vec<u8>,
) {
    if option == opt::SET_META_CONTEXT && !n.structured_replies {
        put_error(
            out,
            option,
            rep::ERR_INVALID,
            "negotiate structured replies first",
        );
        return;
    }
    let mut r = Reader(payload);
    let mut queries = Vec::new();
    let parsed = (|| {
        let name_len = r.u32()?;
        let name = r.bytes(usize::try_from(name_len).ok()?)?;
        let count = r.u32()?;
        for _ in 0..count {
            let len = r.u32()?;
            queries.push(r.bytes(usize::try_from(len).ok()?)?);
        }
        r.0.is_empty().then_some(name)
    })();
    let Some(name) = parsed else {
        put_error(out, option, rep::ERR_INVALID, "malformed meta context payload");
        return;
    };
    if !name_matches(export, name) {
        put_error(out, option, rep::ERR_UNKNOWN, "no such export");
        return;
    }
    let selects = |q: &[u8]| q == BASE_ALLOCATION.as_bytes();
    let matched = if option == opt::LIST_META_CONTEXT {
        // An empty query list, or the bare namespace, lists every context of it.
        queries.is_empty() || queries.iter().any(|q| selects(q) || *q == b"base:")
    } else {
        n.base_allocation = queries.iter().any(|q| selects(q));
        n.base_allocation
    };
    if matched {
        let id = if option == opt::SET_META_CONTEXT {
            BASE_ALLOCATION_ID
        } else {
            0
        };
        let mut data = Vec::with_capacity(4 + BASE_ALLOCATION.len());
        data.extend_from_slice(&id.to_be_bytes());
        data.extend_from_slice(BASE_ALLOCATION.as_bytes());
        put_reply(out, option, rep::META_CONTEXT, &data);
    }
    put_reply(out, option, rep::ACK, &[]);
}

fn name_matches(export: &ExportInfo, name: &[u8]) -> bool {
    name.is_empty() || name == export.name.as_bytes()
}

fn put_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    wire::put_option_reply_header(out, option, reply, len_u32(data.len()));
    out.extend_from_slice(data);
}

fn put_error(out: &mut Vec<u8>, option: u32, reply: u32, message: &str) {
    put_reply(out, option, reply, message.as_bytes());
}

/// Lengths here come from payloads capped at 64 KiB or from the server's own names.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// A cursor over an option payload; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| be_u16(b, 0))
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes(4).map(|b| be_u32(b, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export() -> ExportInfo {
        ExportInfo {
            name: "vol".into(),
            description: "test".into(),
            size: 1 << 20,
            transmission_flags: 1,
            min_block: 1,
            preferred_block: 4096,
            max_block: 1 << 24,
        }
    }

    fn state(tls: Tls) -> Negotiation {
        Negotiation {
            negotiated: Negotiated::default(),
            tls,
            refused_without_tls: 0,
            no_zeroes: true,
        }
    }

    fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&len_u32(name.len()).to_be_bytes());
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&len_u32(queries.len()).to_be_bytes());
        for q in queries {
            p.extend_from_slice(&len_u32(q.len()).to_be_bytes());
            p.extend_from_slice(q.as_bytes());
        }
        p
    }

    fn reply_types(mut out: &[u8]) -> Vec<u32> {
        let mut types = Vec::new();
        while out.len() >= 20 {
            types.push(be_u32(out, 12));
            let len = be_u32(out, 16) as usize;
            out = &out[20 + len..];
        }
        types
    }

    #[test]
    fn set_meta_context_selects_base_allocation_only_after_structured_replies() {
        let mut n = state(Tls::Off);
        let mut out = Vec::new();
        let p = meta_payload("vol", &["base:allocation"]);
        answer_option(opt::SET_META_CONTEXT, &p, &export(), &mut n, &mut out);
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
        assert!(!n.negotiated.base_allocation);

        n.negotiated.structured_replies = true;
        out.clear();
        answer_option(opt::SET_META_CONTEXT, &p, &export(), &mut n, &mut out);
        assert_eq!(reply_types(&out), vec![rep::META_CONTEXT, rep::ACK]);
        assert!(n.negotiated.base_allocation);
    }

    #[test]
    fn go_with_wrong_name_is_answered_unknown_and_negotiation_continues() {
        let mut p = Vec::new();
        p.extend_from_slice(&5u32.to_be_bytes());
        p.extend_from_slice(b"other");
        p.extend_from_slice(&0u16.to_be_bytes());
        let mut out = Vec::new();
        let step = answer_option(opt::GO, &p, &export(), &mut state(Tls::Off), &mut out);
        assert!(matches!(step, Step::Continue));
        assert_eq!(reply_types(&out), vec![rep::ERR_UNKNOWN]);
    }

    #[test]
    fn truncated_info_payload_is_invalid() {
        let mut out = Vec::new();
        answer_option(
            opt::INFO,
            &[0, 0, 0, 9, b'v'],
            &export(),
            &mut state(Tls::Off),
            &mut out,
        );
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
    }

    fn go_payload(name: &str) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&len_u32(name.len()).to_be_bytes());
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&0u16.to_be_bytes());
        p
    }

    #[test]
    fn tls_required_serves_only_starttls_and_abort_until_tls_is_up() {
        let mut n = state(Tls::Required);
        let mut out = Vec::new();
        for option in [
            opt::GO,
            opt::INFO,
            opt::LIST,
            opt::STRUCTURED_REPLY,
            opt::LIST_META_CONTEXT,
            99,
        ] {
            out.clear();
            let step = answer_option(option, &go_payload("vol"), &export(), &mut n, &mut out);
            assert!(matches!(step, Step::Continue), "option {option}");
            assert_eq!(reply_types(&out), vec![rep::ERR_TLS_REQD], "option {option}");
        }
        assert_eq!(
            n.negotiated,
            Negotiated::default(),
            "a refused option changed the state"
        );
        out.clear();
        let step = answer_option(opt::EXPORT_NAME, b"vol", &export(), &mut n, &mut out);
        assert!(matches!(step, Step::TlsRequired) && out.is_empty());
        assert_eq!(n.refused_without_tls, 7);

        out.clear();
        let step = answer_option(opt::STARTTLS, b"x", &export(), &mut n, &mut out);
        assert!(matches!(step, Step::Continue));
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
        out.clear();
        let step = answer_option(opt::STARTTLS, &[], &export(), &mut n, &mut out);
        assert!(matches!(step, Step::StartTls));
        assert_eq!(reply_types(&out), vec![rep::ACK]);

        n.start_tls();
        out.clear();
        let step = answer_option(opt::STARTTLS, &[], &export(), &mut n, &mut out);
        assert!(matches!(step, Step::Continue));
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
        out.clear();
        let step = answer_option(opt::GO, &go_payload("vol"), &export(), &mut n, &mut out);
        assert!(matches!(step, Step::Transmit));
    }

    #[test]
    fn starttls_is_refused_by_policy_where_tls_is_off() {
        let mut out = Vec::new();
        let step = answer_option(opt::STARTTLS, &[], &export(), &mut state(Tls::Off), &mut out);
        assert!(matches!(step, Step::Continue));
        assert_eq!(reply_types(&out), vec![rep::ERR_POLICY]);
    }
}
