//! Bearer tokens with roles: who may call the REST API and the UI's data endpoints. A token is 32 bytes from the
//! OS RNG, shown once when created and stored as the SHA-256 of its text (high-entropy secrets need no slow hash);
//! a presented token is found by comparing that digest with every stored one in constant time. Roles:
//! [`Role::Admin`] (everything), [`Role::Operator`] (volumes, snapshots, backups, jobs, clones, backing images; no
//! settings, backup targets, tokens or node and disk changes), [`Role::Viewer`] (GET only). [`auth`] is the
//! middleware that checks every request, [`bootstrap`] makes the first admin token on an empty store and writes it
//! to [`BOOTSTRAP_FILE`] in the data directory (mode 0600), where the `corral` CLI finds it.

pub mod auth;
pub mod bootstrap;
pub mod cli;
pub mod model;
pub mod openapi;
pub mod routes;
pub mod service;

pub use model::{Role, Token};

/// The file in the manager's data directory holding the admin token made on first start (mode 0600).
pub const BOOTSTRAP_FILE: &str = "admin.token";

/// The name of the admin token made on first start.
pub const BOOTSTRAP_NAME: &str = "admin";
