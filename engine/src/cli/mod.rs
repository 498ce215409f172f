//! Operator commands that live beside the library code they drive (the rest of the CLI is in `main.rs`).

pub mod clone;
