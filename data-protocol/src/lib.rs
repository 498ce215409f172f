//! The data protocol between an engine and its replicas (placeholder; see docs/formats.md).
