//! The flags every Corral binary shares, flattened into each one's clap parser: the log format and level, and the
//! ready file a daemon writes once it serves. [`CommonArgs::init`] turns them into the process setup every `main`
//! does first.

use std::path::PathBuf;

use crate::ready::ReadyFileArg;

/// `--log-format`: how log lines on stderr look.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal only).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// What kind of run this is: decides the log level when neither `--log-level` nor `RUST_LOG` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunKind {
    /// A long-running daemon: `info` (its start, config, state changes).
    Daemon,
    /// A one-shot command: `warn`, so its output is the answer and little else.
    Command,
}

impl RunKind {
    /// `Daemon` when the command line runs the daemon (`serve`), `Command` otherwise.
    pub fn serving(serving: bool) -> Self {
        if serving {
            RunKind::Daemon
        } else {
            RunKind::Command
        }
    }

    fn default_level(self) -> &'static str {
        match self {
            RunKind::Daemon => "info",
            RunKind::Command => "warn",
        }
    }
}

/// `--log-level` is not a filter `tracing` understands.
#[derive(Debug, thiserror::Error)]
#[error("--log-level {filter:?}: {reason}")]
pub struct LogLevelError {
    pub filter: String,
    pub reason: String,
}

/// The log flags (global: accepted before or after the subcommand).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// Log format on stderr: text or json.
    #[arg(long, global = true, value_enum, default_value_t, env = "CORRAL_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Log filter (`debug`, `info`, `warn`, or per module: `info,replica=debug`). Overrides RUST_LOG; without
    /// either, daemons log at info and one-shot commands at warn.
    #[arg(long, global = true, value_name = "FILTER", env = "CORRAL_LOG_LEVEL")]
    pub log_level: Option<String>,
}

impl LogArgs {
    /// Sets up `tracing` on stderr as the flags say.
    ///
    /// # Errors
    /// When `--log-level` is not a valid filter (a typo would otherwise silence every log line).
    pub fn init(&self, kind: RunKind) -> Result<(), LogLevelError> {
        let filter = match &self.log_level {
            Some(l) => tracing_subscriber::EnvFilter::try_new(l).map_err(|e| LogLevelError {
                filter: l.clone(),
                reason: e.to_string(),
            })?,
            None => tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(kind.default_level())),
        };
        let b = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            // Colour codes only for a human at a terminal: daemon logs redirected to files stay plain text.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        // A second init (a test calling main twice) keeps the first subscriber rather than panicking.
        let _ = match self.log_format {
            LogFormat::Json => b.json().try_init(),
            LogFormat::Text => b.try_init(),
        };
        Ok(())
    }
}

/// The flags of every daemon binary: `--log-format`, `--log-level` and `--ready-file`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CommonArgs {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub ready: ReadyFileArg,
}

/// What `main` keeps from [`CommonArgs::init`].
#[derive(Debug, Clone, Default)]
pub struct Process {
    /// `--ready-file`: where the daemon reports its listeners once it serves.
    pub ready_file: Option<PathBuf>,
}

impl CommonArgs {
    /// Sets up logging (`kind` picks the default level); returns what the rest of `main` needs.
    ///
    /// # Errors
    /// As [`LogArgs::init`].
    pub fn init(&self, kind: RunKind) -> Result<Process, LogLevelError> {
        self.log.init(kind)?;
        Ok(Process {
            ready_file: self.ready.ready_file.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        common: CommonArgs,
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Cmd {
        Serve,
    }

    #[test]
    fn common_flags_are_taken_before_and_after_the_subcommand() {
        let c =
            Cli::try_parse_from(["x", "--log-format", "json", "serve", "--ready-file", "/r.json"]).unwrap();
        assert_eq!(c.common.log.log_format, LogFormat::Json);
        assert_eq!(
            c.common.ready.ready_file.as_deref(),
            Some(std::path::Path::new("/r.json"))
        );
        let c = Cli::try_parse_from(["x", "serve", "--log-level", "debug"]).unwrap();
        assert_eq!(c.common.log.log_level.as_deref(), Some("debug"));
    }

    #[test]
    fn an_unknown_log_format_is_refused() {
        let e = Cli::try_parse_from(["x", "--log-format", "xml", "serve"]).unwrap_err();
        assert!(e.to_string().contains("xml"), "{e}");
    }

    #[test]
    fn a_bad_log_filter_is_an_error_naming_it() {
        let a = LogArgs {
            log_format: LogFormat::Text,
            log_level: Some("info,=[".into()),
        };
        let e = a.init(RunKind::Command).unwrap_err();
        assert!(e.to_string().contains("--log-level"), "{e}");
    }
}
