//! Corral data source: the HTTP server that prepares the first copy of a backing image (skeleton; see issue 6)
