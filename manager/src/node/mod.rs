//! Node lifecycle beyond the heartbeat: cordon (no new replicas), uncordon, and drain (every replica moved off,
//! rebuilt elsewhere first) — the rules in [`drain`], the REST routes in [`routes`], the CLI in [`cli`].

pub mod cli;
pub mod drain;
pub mod openapi;
pub mod routes;
pub mod views;
