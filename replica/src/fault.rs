//! Fault injection for failure tests (cargo feature `fault-injection`, off by default; none of this exists in a
//! normal build).
//!
//! The engine's tests must see a replica fail in a chosen way at a chosen moment, not when a timer happens to
//! fire. A [`FaultInjector`] holds at most one [`FaultRule`] per data-protocol operation; `ReplicaHost`'s
//! `BlockBackend` methods consult it before doing anything. A rule lets `after` operations pass, then applies
//! its action to every later one until it is cleared or replaced:
//!
//! | action | effect |
//! |---|---|
//! | `error` | the request fails with an `Io` error ("injected fault") |
//! | `no-space` | the request fails with `NoSpace` |
//! | `delay:MS` | the request sleeps MS milliseconds, then runs |
//! | `hang` | the request blocks (its IO thread waits on a condvar) until the rule is cleared or replaced, then runs |
//! | `drop` | the server answers nothing and drops that connection (`data_protocol::ErrorKind::DropConnection`) |
//!
//! Rules come from `corral-replica serve --fault OP=ACTION[,after=N]` (repeatable) and from the metrics server's
//! `/debug/faults` endpoint ([`routes`]): `GET` lists the rules, `POST` sets one rule or an array of them (JSON
//! `{"op": "write", "action": "delay:200", "after": 3}`), `DELETE` clears all of them (or one, with `?op=write`),
//! releasing every hung request.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use data_protocol::{BackendError, ErrorKind};
use serde::{Deserialize, Serialize};

/// A data-protocol operation a rule applies to. Serialized as `read`, `write`, `unmap`, `write-zeroes`,
/// `flush`, `block-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultOp {
    Read,
    Write,
    Unmap,
    WriteZeroes,
    Flush,
    BlockStatus,
}

impl FaultOp {
    const ALL: [Self; 6] = [
        Self::Read,
        Self::Write,
        Self::Unmap,
        Self::WriteZeroes,
        Self::Flush,
        Self::BlockStatus,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Unmap => "unmap",
            Self::WriteZeroes => "write-zeroes",
            Self::Flush => "flush",
            Self::BlockStatus => "block-status",
        }
    }
}

impl fmt::Display for FaultOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FaultOp {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|op| op.name() == s).ok_or_else(|| {
            format!(
                "unknown operation {s:?}: expected read, write, unmap, write-zeroes, flush or block-status"
            )
        })
    }
}

/// What happens to an operation a rule catches. Written as `error`, `no-space`, `delay:MS`, `hang`, `drop`
/// (on the command line and in JSON alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum FaultAction {
    /// Fail with an `Io` error.
    Error,
    /// Fail with `NoSpace`.
    NoSpace,
    /// Sleep, then run the operation.
    Delay(Duration),
    /// Block until the rule is cleared or replaced, then run the operation.
    Hang,
    /// Drop the connection without answering.
    Drop,
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Error => f.write_str("error"),
            Self::NoSpace => f.write_str("no-space"),
            Self::Delay(d) => write!(f, "delay:{}", d.as_millis()),
            Self::Hang => f.write_str("hang"),
            Self::Drop => f.write_str("drop"),
        }
    }
}

impl FromStr for FaultAction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "error" => Self::Error,
            "no-space" => Self::NoSpace,
            "hang" => Self::Hang,
            "drop" => Self::Drop,
            _ => match s.strip_prefix("delay:") {
                Some(ms) => Self::Delay(Duration::from_millis(
                    ms.parse()
                        .map_err(|_| format!("{s:?}: expected delay:MILLISECONDS"))?,
                )),
                None => {
                    return Err(format!(
                        "unknown action {s:?}: expected error, no-space, delay:MS, hang or drop"
                    ));
                }
            },
        })
    }
}

impl TryFrom<String> for FaultAction {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<FaultAction> for String {
    fn from(a: FaultAction) -> Self {
        a.to_string()
    }
}

/// One rule: `op`'s first `after` operations pass, every later one gets `action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRule {
    pub op: FaultOp,
    pub action: FaultAction,
    #[serde(default)]
    pub after: u64,
}

impl FromStr for FaultRule {
    type Err = String;

    /// `OP=ACTION[,after=N]`, e.g. `write=error`, `read=delay:200`, `flush=hang,after=3`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (op, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected OP=ACTION[,after=N]"))?;
        let (action, after) = match rest.split_once(',') {
            Some((action, opt)) => {
                let n = opt
                    .strip_prefix("after=")
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| format!("{s:?}: expected after=N after the action"))?;
                (action, n)
            }
            None => (rest, 0),
        };
        Ok(Self {
            op: op.parse()?,
            action: action.parse()?,
            after,
        })
    }
}

impl fmt::Display for FaultRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.op, self.action)?;
        if self.after > 0 {
            write!(f, ",after={}", self.after)?;
        }
        Ok(())
    }
}

/// A rule as installed, with what it has seen (`GET /debug/faults`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRuleStatus {
    #[serde(flatten)]
    pub rule: FaultRule,
    /// Operations of `op` seen since the rule was set (passed and caught).
    pub seen: u64,
    /// Operations the action was applied to.
    pub hits: u64,
}

#[derive(Debug)]
struct Armed {
    status: FaultRuleStatus,
    /// Distinguishes this installation from a later rule for the same operation: a hung request waits until
    /// the rule it hung on is gone.
    id: u64,
}

#[derive(Debug, Default)]
struct Rules {
    by_op: BTreeMap<FaultOp, Armed>,
    next_id: u64,
}

/// The rules in force for one replica host, shared by its data-protocol backend and the HTTP endpoint.
#[derive(Debug, Default)]
pub struct FaultInjector {
    rules: Mutex<Rules>,
    /// Signalled whenever a rule is replaced or cleared (wakes hung requests).
    changed: Condvar,
}

impl FaultInjector {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Installs `rule`, replacing any rule for the same operation (requests hung on that one are released).
    pub fn set(&self, rule: FaultRule) {
        let mut rules = self.lock();
        rules.next_id += 1;
        let id = rules.next_id;
        let status = FaultRuleStatus {
            rule,
            seen: 0,
            hits: 0,
        };
        rules.by_op.insert(rule.op, Armed { status, id });
        drop(rules);
        self.changed.notify_all();
        tracing::warn!(rule = %rule, "fault injection rule set");
    }

    /// Removes the rule for `op` (every rule with `None`) and releases the requests hung on it.
    pub fn clear(&self, op: Option<FaultOp>) {
        let mut rules = self.lock();
        match op {
            Some(op) => {
                rules.by_op.remove(&op);
            }
            None => rules.by_op.clear(),
        }
        drop(rules);
        self.changed.notify_all();
        tracing::warn!(op = ?op, "fault injection rules cleared");
    }

    /// The rules in force, by operation.
    pub fn rules(&self) -> Vec<FaultRuleStatus> {
        self.lock().by_op.values().map(|a| a.status).collect()
    }

    /// Applies the rule for `op`, if any, to one operation about to run: `Ok` lets it run (possibly after a
    /// delay or a hang), `Err` is what the backend answers instead.
    pub fn check(&self, op: FaultOp) -> Result<(), BackendError> {
        let mut rules = self.lock();
        let Some(armed) = rules.by_op.get_mut(&op) else {
            return Ok(());
        };
        armed.status.seen += 1;
        if armed.status.seen <= armed.status.rule.after {
            return Ok(());
        }
        armed.status.hits += 1;
        let id = armed.id;
        let action = armed.status.rule.action;
        tracing::debug!(%op, %action, "injecting fault");
        match action {
            FaultAction::Error => Err(BackendError::new(
                ErrorKind::Io,
                format!("injected fault: {op} error"),
            )),
            FaultAction::NoSpace => Err(BackendError::new(
                ErrorKind::NoSpace,
                format!("injected fault: {op} no space"),
            )),
            FaultAction::Drop => Err(BackendError::new(
                ErrorKind::DropConnection,
                format!("injected fault: {op} drops the connection"),
            )),
            FaultAction::Delay(d) => {
                drop(rules);
                std::thread::sleep(d);
                Ok(())
            }
            FaultAction::Hang => {
                let _released = self
                    .changed
                    .wait_while(rules, |r| r.by_op.get(&op).is_some_and(|a| a.id == id))
                    .unwrap_or_else(PoisonError::into_inner);
                Ok(())
            }
        }
    }
}

/// Body of `POST /debug/faults`: one rule or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RulesBody {
    One(FaultRule),
    Many(Vec<FaultRule>),
}

#[derive(Debug, Deserialize)]
struct ClearQuery {
    op: Option<FaultOp>,
}

async fn list(State(f): State<Arc<FaultInjector>>) -> Json<Vec<FaultRuleStatus>> {
    Json(f.rules())
}

async fn set(State(f): State<Arc<FaultInjector>>, Json(body): Json<RulesBody>) -> Json<Vec<FaultRuleStatus>> {
    match body {
        RulesBody::One(rule) => f.set(rule),
        RulesBody::Many(rules) => rules.into_iter().for_each(|r| f.set(r)),
    }
    Json(f.rules())
}

async fn clear(
    State(f): State<Arc<FaultInjector>>,
    Query(q): Query<ClearQuery>,
) -> Json<Vec<FaultRuleStatus>> {
    f.clear(q.op);
    Json(f.rules())
}

/// `GET`/`POST`/`DELETE /debug/faults`, to be merged into the metrics server. Every method answers with the
/// rules in force afterwards (a JSON array of [`FaultRuleStatus`]); a malformed body is answered 4xx by axum.
pub fn routes(faults: Arc<FaultInjector>) -> Router {
    Router::new()
        .route("/debug/faults", get(list).post(set).delete(clear))
        .with_state(faults)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn rules_parse_from_the_flag_form_and_print_back() {
        for s in [
            "write=error",
            "read=delay:250",
            "flush=hang,after=3",
            "block-status=drop",
            "unmap=no-space",
        ] {
            let r: FaultRule = s.parse().unwrap();
            assert_eq!(r.to_string(), s);
        }
        let r: FaultRule = "write-zeroes=no-space,after=2".parse().unwrap();
        assert_eq!(
            r,
            FaultRule {
                op: FaultOp::WriteZeroes,
                action: FaultAction::NoSpace,
                after: 2
            }
        );
        for bad in [
            "write",
            "write=explode",
            "erase=error",
            "read=delay:soon",
            "read=error,before=2",
        ] {
            assert!(bad.parse::<FaultRule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn rules_parse_from_json() {
        let r: FaultRule = serde_json::from_str(r#"{"op":"write-zeroes","action":"delay:20"}"#).unwrap();
        assert_eq!(r.action, FaultAction::Delay(Duration::from_millis(20)));
        assert_eq!(r.after, 0);
        assert!(serde_json::from_str::<FaultRule>(r#"{"op":"write","action":"boom"}"#).is_err());
    }

    #[test]
    fn after_lets_operations_pass_then_the_action_applies_until_cleared() {
        let f = FaultInjector::new();
        f.set("write=error,after=2".parse().unwrap());
        assert!(f.check(FaultOp::Write).is_ok());
        assert!(f.check(FaultOp::Read).is_ok());
        assert!(f.check(FaultOp::Write).is_ok());
        let err = f.check(FaultOp::Write).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Io);
        assert!(err.message.contains("injected fault"));
        assert_eq!(f.check(FaultOp::Write).unwrap_err().kind, ErrorKind::Io);
        assert_eq!(f.rules()[0].seen, 4);
        assert_eq!(f.rules()[0].hits, 2);
        f.clear(Some(FaultOp::Write));
        assert!(f.check(FaultOp::Write).is_ok());
    }

    #[test]
    fn a_hung_operation_runs_once_its_rule_is_cleared() {
        let f = Arc::new(FaultInjector::new());
        f.set("flush=hang".parse().unwrap());
        let f2 = f.clone();
        let started = Instant::now();
        let hung = std::thread::spawn(move || f2.check(FaultOp::Flush));
        while f.rules()[0].hits == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(!hung.is_finished());
        f.clear(None);
        assert!(hung.join().unwrap().is_ok());
        assert!(started.elapsed() >= Duration::from_millis(50));
    }
}
