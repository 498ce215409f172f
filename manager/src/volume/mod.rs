//! The volume, the core resource: [`routes`] (REST for volumes and their snapshots) and [`controller`] (the
//! leader's reconcile of a volume's spec into replica and engine documents). Its model is
//! [`crate::model::Volume`]; placement is [`crate::scheduler`]; calls to its engine go through
//! [`crate::volume_engine`].

pub mod cli;
pub mod controller;
pub mod openapi;
pub mod routes;
pub mod views;
