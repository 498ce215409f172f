//! Every crate of the workspace has layered modules: no module reaches, through `crate::` and `super::` paths,
//! back to itself. A cycle means two concepts cannot be understood or changed apart (a job that needs the server
//! that runs it, a storage type that needs the gRPC layer); the fix is to move the shared piece into a leaf
//! module both can use. The graph is read from the source text: one node per module file under `src/` (binaries
//! under `src/bin/` excluded, test modules after `#[cfg(test)]` ignored), one edge per path that names another
//! module.
//!
//! The same holds one level up: folded to their top-level modules (the folders and files directly under `src/`),
//! a crate's modules must form no cycle either, so that each feature folder can be read and changed beside the
//! ones below it. The back-edges that close today's folder cycles are pinned in [`FOLDER_BACK_EDGES`], a ratchet:
//! a new back-edge fails, and so does a pinned one that no longer closes a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// `a/b.rs` and `a/b/mod.rs` are `a::b`; `lib.rs` and `main.rs` are the crate root.
fn module_name(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        return "crate".into();
    }
    parts.join("::")
}

fn rust_files(dir: &Path, src: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p != src.join("bin") {
                rust_files(&p, src, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The text that counts: comment lines dropped, everything from the first `#[cfg(test)]` on cut off.
fn code(text: &str) -> String {
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect();
    let joined = kept.join("\n");
    match joined.find("#[cfg(test)]") {
        Some(i) => joined[..i].to_owned(),
        None => joined,
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands the path that starts at `rest` (just after `crate::` or `super::`) into the module paths it names:
/// `a::b::C` gives `[a, b, C]`, `{a::X, b::{c, d}}` gives one path per leaf.
fn expand(rest: &str) -> Vec<Vec<String>> {
    fn parse(s: &[char], i: &mut usize) -> Vec<Vec<String>> {
        let mut prefix = Vec::new();
        loop {
            while *i < s.len() && s[*i].is_whitespace() {
                *i += 1;
            }
            if *i < s.len() && s[*i] == '{' {
                *i += 1;
                let mut out = Vec::new();
                loop {
                    while *i < s.len() && (s[*i].is_whitespace() || s[*i] == ',') {
                        *i += 1;
                    }
                    if *i >= s.len() || s[*i] == '}' {
                        *i += 1;
                        break;
                    }
                    for tail in parse(s, i) {
                        let mut p = prefix.clone();
                        p.extend(tail);
                        out.push(p);
                    }
                }
                return out;
            }
            let start = *i;
            while *i < s.len() && is_ident(s[*i]) {
                *i += 1;
            }
            if start == *i {
                return vec![prefix];
            }
            prefix.push(s[start..*i].iter().collect());
            if s.get(*i) == Some(&':') && s.get(*i + 1) == Some(&':') {
                *i += 2;
            } else {
                // `as` renames and anything after the path end it.
                return vec![prefix];
            }
        }
    }
    let chars: Vec<char> = rest.chars().take(4000).collect();
    parse(&chars, &mut 0)
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect()
}

/// The module each `crate::…` and `super::…` path of `module`'s code names (the longest known prefix).
fn edges_of(module: &str, text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let parent: Vec<&str> = if module == "crate" {
        vec![]
    } else {
        let mut p: Vec<&str> = module.split("::").collect();
        p.pop();
        p
    };
    let mut paths = Vec::new();
    for (keyword, base) in [("crate::", vec![]), ("super::", parent)] {
        let mut from = 0;
        while let Some(at) = text[from..].find(keyword) {
            let start = from + at;
            from = start + keyword.len();
            // `$crate::`, `foo_crate::` and the second `super::` of `super::super::` are not path starts.
            if text[..start]
                .chars()
                .next_back()
                .is_some_and(|c| is_ident(c) || c == '$' || c == ':')
            {
                continue;
            }
            let mut base = base.clone();
            while text[from..].starts_with(keyword) {
                base.pop();
                from += keyword.len();
            }
            for p in expand(&text[from..]) {
                let mut full: Vec<String> = base.iter().map(|s| (*s).to_owned()).collect();
                full.extend(p);
                paths.push(full);
            }
        }
    }
    let mut out = BTreeSet::new();
    for path in paths {
        for k in (1..=path.len()).rev() {
            let cand = path[..k].join("::");
            if modules.contains(&cand) {
                let nested =
                    cand.starts_with(&format!("{module}::")) || module.starts_with(&format!("{cand}::"));
                if cand != module && !nested {
                    out.insert(cand);
                }
                break;
            }
        }
    }
    out
}

/// The module graph of the crate whose sources are under `src`.
fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, src, &mut files);
    let named: Vec<(String, PathBuf)> = files.into_iter().map(|f| (module_name(src, &f), f)).collect();
    let modules: BTreeSet<String> = named.iter().map(|(m, _)| m.clone()).collect();
    let mut graph = Graph::new();
    for (m, f) in &named {
        let text = code(&fs::read_to_string(f).unwrap_or_default());
        graph
            .entry(m.clone())
            .or_default()
            .extend(edges_of(m, &text, &modules));
    }
    graph
}

/// The strongly connected components with more than one module (Tarjan), each sorted.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            let graph = self.graph;
            for w in graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    comp.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests sits in the workspace root")
        .to_owned()
}

/// Cycles tolerated while their owners break them. Empty: every crate's module graph is acyclic. A cycle added
/// here must be removed again once it is broken (a listed cycle that is gone fails the test).
const KNOWN_CYCLES: &[&str] = &[];

#[test]
fn no_crate_has_a_module_cycle() {
    let root = workspace_root();
    let mut found = Vec::new();
    let mut crates = 0;
    for e in fs::read_dir(&root).unwrap().flatten() {
        let dir = e.path();
        if !(dir.join("Cargo.toml").is_file() && dir.join("src").is_dir()) {
            continue;
        }
        crates += 1;
        for c in cycles(&module_graph(&dir.join("src"))) {
            found.push(format!(
                "{} CYCLE: {}",
                dir.file_name().unwrap().to_string_lossy(),
                c.join(", ")
            ));
        }
    }
    assert!(
        crates >= 10,
        "found only {crates} crates under {}",
        root.display()
    );
    let new: Vec<&String> = found
        .iter()
        .filter(|c| !KNOWN_CYCLES.contains(&c.as_str()))
        .collect();
    let gone: Vec<&&str> = KNOWN_CYCLES
        .iter()
        .filter(|k| !found.iter().any(|c| c == *k))
        .collect();
    assert!(
        new.is_empty(),
        "module cycles (move what both sides need into a leaf module):\n{}",
        new.iter().map(|c| c.as_str()).collect::<Vec<_>>().join("\n")
    );
    assert!(
        gone.is_empty(),
        "cycles fixed: delete them from KNOWN_CYCLES: {gone:?}"
    );
}

/// The graph of top-level modules: every module folded to its first path segment (`backup::routes` is `backup`).
fn folder_graph(graph: &Graph) -> Graph {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_owned();
    let mut out = Graph::new();
    for (m, targets) in graph {
        let from = top(m);
        let entry = out.entry(from.clone()).or_default();
        entry.extend(targets.iter().map(|t| top(t)).filter(|t| *t != from));
    }
    out
}

/// The folder edges (`crate`, from, to) that close cycles, pinned while their owners break them (issue 44): none
/// is left (the manager's folders layer, bottom to top, as `api` (the route kit, which names no feature),
/// `backup_target`, `v2`, `node`, `backing_image`, `backup`, `job`, …, `server`). Never add one: move what both
/// sides need into a module below both.
const FOLDER_BACK_EDGES: &[(&str, &str, &str)] = &[];

/// What is wrong with the folder graph of `krate` (whose modules are `graph`) against the pinned back-edges:
/// cycles left once the pinned edges are taken out, and pinned edges that no longer close a cycle.
fn folder_violations(krate: &str, graph: &Graph, pinned: &[(&str, &str, &str)]) -> Vec<String> {
    let folders = folder_graph(graph);
    let pinned: BTreeSet<(&str, &str)> = pinned
        .iter()
        .filter(|(c, _, _)| *c == krate)
        .map(|(_, a, b)| (*a, *b))
        .collect();
    let mut out = Vec::new();
    let mut rest = folders.clone();
    for (a, b) in &pinned {
        if let Some(t) = rest.get_mut(*a) {
            t.remove(*b);
        }
    }
    for c in cycles(&rest) {
        let inner: Vec<String> = c
            .iter()
            .flat_map(|a| {
                rest[a]
                    .iter()
                    .filter(|b| c.contains(b))
                    .map(move |b| format!("{a} -> {b}"))
            })
            .collect();
        out.push(format!(
            "{krate} FOLDER CYCLE: {} (edges: {})",
            c.join(", "),
            inner.join(", ")
        ));
    }
    let on_cycle: Vec<BTreeSet<String>> = cycles(&folders)
        .into_iter()
        .map(|c| c.into_iter().collect())
        .collect();
    for (a, b) in &pinned {
        let exists = folders.get(*a).is_some_and(|t| t.contains(*b));
        let closes = on_cycle.iter().any(|c| c.contains(*a) && c.contains(*b));
        if !(exists && closes) {
            out.push(format!(
                "{krate} pinned back-edge {a} -> {b} no longer closes a cycle: delete it from FOLDER_BACK_EDGES"
            ));
        }
    }
    out
}

#[test]
fn no_crate_has_a_folder_cycle_beyond_the_pinned_back_edges() {
    let root = workspace_root();
    let mut found = Vec::new();
    let mut crates = BTreeSet::new();
    for e in fs::read_dir(&root).unwrap().flatten() {
        let dir = e.path();
        if !(dir.join("Cargo.toml").is_file() && dir.join("src").is_dir()) {
            continue;
        }
        let krate = dir.file_name().unwrap().to_string_lossy().into_owned();
        found.extend(folder_violations(
            &krate,
            &module_graph(&dir.join("src")),
            FOLDER_BACK_EDGES,
        ));
        crates.insert(krate);
    }
    let unknown: Vec<_> = FOLDER_BACK_EDGES
        .iter()
        .filter(|(c, _, _)| !crates.contains(*c))
        .collect();
    assert!(unknown.is_empty(), "pinned edges of unknown crates: {unknown:?}");
    assert!(
        found.is_empty(),
        "top-level module cycles (move what both sides need into a folder below both):\n{}",
        found.join("\n")
    );
}

/// Writes a crate's `src/` from `(path, text)` pairs.
fn synthetic(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let p = dir.path().join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    dir
}

#[test]
fn a_cycle_through_crate_and_super_paths_is_found() {
    let src = synthetic(&[
        ("lib.rs", "pub mod job;\npub mod service;\npub mod spec;\n"),
        ("job.rs", "use crate::spec::Spec;\n"),
        // A grouped import, a nested module and a `super::` sibling path close the loop job → spec → service → job.
        (
            "spec.rs",
            "use crate::{error::E, service::{grpc::Server, Host}};\n",
        ),
        ("service/mod.rs", "pub mod grpc;\n"),
        ("service/grpc.rs", "use super::super::job::run;\n"),
        ("error.rs", "// use crate::job; (a comment is no edge)\n"),
    ]);
    let graph = module_graph(src.path());
    assert_eq!(
        graph["spec"],
        BTreeSet::from([
            "error".to_owned(),
            "service".to_owned(),
            "service::grpc".to_owned()
        ])
    );
    assert_eq!(
        cycles(&graph),
        vec![vec![
            "job".to_owned(),
            "service::grpc".to_owned(),
            "spec".to_owned()
        ]]
    );
}

#[test]
fn layered_modules_and_test_code_make_no_cycle() {
    let src = synthetic(&[
        ("lib.rs", "pub mod chain;\npub mod replica;\npub mod locks;\n"),
        ("locks.rs", "pub fn lock() {}\n"),
        ("chain.rs", "use crate::locks::lock;\n"),
        // Test modules may use anything: they are not part of the layering.
        (
            "replica.rs",
            "use crate::chain::Chain;\n#[cfg(test)]\nmod tests { use crate::replica; }\n",
        ),
        ("bin/tool.rs", "use crate::replica;\n"),
    ]);
    let graph = module_graph(src.path());
    assert!(!graph.contains_key("bin::tool"), "binaries are separate crates");
    assert_eq!(graph["replica"], BTreeSet::from(["chain".to_owned()]));
    assert!(cycles(&graph).is_empty(), "{graph:?}");
}

#[test]
fn a_folder_cycle_fails_unless_its_back_edge_is_pinned_and_a_stale_pin_fails() {
    // Files form no cycle (`a::x` -> `b` -> `a::y`), their folders do: `a` <-> `b`.
    let src = synthetic(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a/mod.rs", "pub mod x;\npub mod y;\n"),
        ("a/x.rs", "use crate::b::run;\n"),
        ("a/y.rs", "pub fn f() {}\n"),
        ("b.rs", "use crate::a::y::f;\nuse crate::c;\n"),
        ("c.rs", "pub fn g() {}\n"),
    ]);
    let graph = module_graph(src.path());
    assert!(cycles(&graph).is_empty(), "{graph:?}");
    assert_eq!(
        folder_violations("k", &graph, &[]),
        vec!["k FOLDER CYCLE: a, b (edges: a -> b, b -> a)".to_owned()]
    );
    assert!(folder_violations("k", &graph, &[("k", "b", "a")]).is_empty());
    // A pin of another crate does not count; a pin whose edge is not on a cycle (b -> c) or absent fails.
    assert_eq!(folder_violations("k", &graph, &[("other", "b", "a")]).len(), 1);
    assert_eq!(
        folder_violations("k", &graph, &[("k", "b", "a"), ("k", "b", "c"), ("k", "c", "a")]),
        vec![
            "k pinned back-edge b -> c no longer closes a cycle: delete it from FOLDER_BACK_EDGES".to_owned(),
            "k pinned back-edge c -> a no longer closes a cycle: delete it from FOLDER_BACK_EDGES".to_owned(),
        ]
    );
}
