//! The route table: every route registered once, with the summary the OpenAPI document shows. A leaf module, so
//! resource modules (e.g. `backing_image::routes`) can register theirs without depending on the API's handlers.

use std::collections::BTreeMap;

use axum::routing::{MethodFilter, MethodRouter, on};

use crate::context::Ctx;

/// Registers routes and remembers them for the OpenAPI document.
pub struct Routes {
    pub(crate) paths: BTreeMap<&'static str, MethodRouter<Ctx>>,
    /// (path, method, summary)
    pub documented: Vec<(&'static str, &'static str, &'static str)>,
}

impl Routes {
    pub(crate) fn new() -> Self {
        Self {
            paths: BTreeMap::new(),
            documented: Vec::new(),
        }
    }

    pub fn add<H, T>(&mut self, method: &'static str, path: &'static str, summary: &'static str, handler: H)
    where
        H: axum::handler::Handler<T, Ctx>,
        T: 'static,
    {
        let filter = match method {
            "get" => MethodFilter::GET,
            "post" => MethodFilter::POST,
            "put" => MethodFilter::PUT,
            _ => MethodFilter::DELETE,
        };
        let mr = self.paths.remove(path).unwrap_or_default();
        self.paths.insert(path, mr.merge(on(filter, handler)));
        self.documented.push((path, method, summary));
    }
}
