//! NBD frontend (placeholder).
