//! The names of what a node's data plane can do (`VersionGetResponse.features`): the data engines its binaries
//! run and the volume options the manager passes them as flags. The instance manager reports the set it was built
//! with; the manager refuses work a node's data plane lacks. Also which process arguments need which feature, so
//! the instance manager refuses to start what its build does not offer.

/// Data engine v1: `corral-engine` and `corral-replica serve` (replica files in a directory).
pub const ENGINE_V1: &str = "v1";
/// Data engine v2: `corral-replica serve-lvstore` (replicas as lvols of a disk's lvstore).
pub const ENGINE_V2: &str = "v2";
/// `--disable-revision-counter` (and `--salvage-requested`) on engines and replicas.
pub const DISABLE_REVISION_COUNTER: &str = "disable-revision-counter";
/// `--backing-file` (a backing image under a replica's data).
pub const BACKING_IMAGE: &str = "backing-image";

/// `--generation` on engines (fencing a stale engine, issue 39): an engine binary older than it refuses the flag,
/// so the manager passes it only to a data plane that has it.
pub const ENGINE_GENERATION: &str = "engine-generation";

/// Every feature of a full build, in the order they are shown.
pub const ALL: [&str; 5] = [
    ENGINE_V1,
    ENGINE_V2,
    DISABLE_REVISION_COUNTER,
    BACKING_IMAGE,
    ENGINE_GENERATION,
];

/// The features a data-plane process started with `binary args` needs, as far as its arguments show.
pub fn needed_by(binary: &str, args: &[String]) -> Vec<&'static str> {
    let mut out = Vec::new();
    let first = args.first().map(String::as_str);
    // The engine binary serves volumes of either engine (which one its arguments do not say); the manager checks
    // a volume's engine against the node's features before it attaches the volume there.
    match (binary, first) {
        ("corral-replica", Some("serve-lvstore")) => out.push(ENGINE_V2),
        ("corral-replica", _) => out.push(ENGINE_V1),
        _ => {}
    }
    let has = |flag: &str| {
        args.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    if has("--disable-revision-counter") || has("--salvage-requested") {
        out.push(DISABLE_REVISION_COUNTER);
    }
    if binary == "corral-replica" && has("--backing-file") {
        out.push(BACKING_IMAGE);
    }
    if binary == "corral-engine" && has("--generation") {
        out.push(ENGINE_GENERATION);
    }
    out
}

/// `features` as reported by a data plane: an empty list comes from a build older than the report, which ran the
/// full set of its day (v1, v2, both options).
pub fn effective(features: &[String]) -> Vec<String> {
    if features.is_empty() {
        ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        features.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn each_process_needs_its_engine_and_the_options_its_flags_name() {
        assert_eq!(
            needed_by("corral-replica", &args(&["serve", "--dir", "/d"])),
            [ENGINE_V1]
        );
        assert_eq!(
            needed_by("corral-replica", &args(&["serve-lvstore", "--disk", "/d"])),
            [ENGINE_V2]
        );
        assert_eq!(
            needed_by(
                "corral-engine",
                &args(&["serve", "--disable-revision-counter", "--salvage-requested"])
            ),
            [DISABLE_REVISION_COUNTER]
        );
        assert_eq!(
            needed_by("corral-replica", &args(&["serve", "--backing-file=/b"])),
            [ENGINE_V1, BACKING_IMAGE]
        );
        assert_eq!(
            needed_by("corral-engine", &args(&["serve", "--generation", "3"])),
            [ENGINE_GENERATION]
        );
        assert!(needed_by("corral-bim", &args(&["serve"])).is_empty());
    }

    #[test]
    fn a_data_plane_reporting_no_features_predates_the_report_and_has_them_all() {
        assert_eq!(effective(&[]), ALL);
        assert_eq!(effective(&["v1".to_owned()]), ["v1"]);
    }
}
