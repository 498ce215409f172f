//! Cluster-wide settings (`crate::model::SETTINGS`, stored as [`crate::model::Setting`] documents): [`routes`]
//! (`/v1/settings`), [`views`] (their JSON shapes) and [`openapi`] (what each setting's value must look like, one
//! concrete path per setting in the document).

pub mod cli;
pub mod openapi;
pub mod routes;
pub mod views;
