//! What this build of the instance manager is and can do, fixed when it is compiled: its version
//! (`CORRAL_BUILD_VERSION`, else the crate's) and its data-plane features (`CORRAL_IM_FEATURES`, a comma list of
//! `corral_proto::data_plane` names, else all of them). A build with `CORRAL_IM_FEATURES=v1` is an older data
//! plane in earnest: it reports only v1 and refuses to start any process that needs more.

use corral_proto::data_plane;

use crate::ImError;

/// The build version reported by `VersionGet`.
pub const VERSION: &str = match option_env!("CORRAL_BUILD_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

/// The features list this build was compiled with (None: all).
const FEATURES: Option<&str> = option_env!("CORRAL_IM_FEATURES");

/// This build's features; an unknown name in `CORRAL_IM_FEATURES` is an error (checked at start, so a typo in a
/// build never passes for a data plane lacking a feature).
pub fn features() -> Result<Vec<&'static str>, String> {
    parse(FEATURES)
}

fn parse(list: Option<&'static str>) -> Result<Vec<&'static str>, String> {
    let Some(list) = list else {
        return Ok(data_plane::ALL.to_vec());
    };
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if !data_plane::ALL.contains(&name) {
            return Err(format!(
                "CORRAL_IM_FEATURES names {name:?}, not a data-plane feature: {}",
                data_plane::ALL.join(", ")
            ));
        }
        if !out.contains(&name) {
            out.push(name);
        }
    }
    if out.is_empty() {
        return Err("CORRAL_IM_FEATURES is empty: a data plane runs at least one engine".to_owned());
    }
    Ok(out)
}

/// Refuses a process needing a feature `have` lacks, naming it and this build.
pub fn check_process(have: &[&str], binary: &str, args: &[String]) -> Result<(), ImError> {
    let missing: Vec<&str> = data_plane::needed_by(binary, args)
        .into_iter()
        .filter(|f| !have.contains(f))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(ImError::Unsupported(format!(
        "this data plane (corral-im {VERSION}, features {}) cannot run {binary} with {}: missing {}",
        have.join(","),
        args.first().map_or("no arguments", String::as_str),
        missing.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_feature_list_is_checked_and_defaults_to_all() {
        assert_eq!(parse(None).unwrap(), data_plane::ALL);
        assert_eq!(
            parse(Some("v1, v1,disable-revision-counter")).unwrap(),
            ["v1", "disable-revision-counter"]
        );
        assert!(parse(Some("v1,v3")).unwrap_err().contains("\"v3\""));
        assert!(parse(Some(" ,")).is_err());
    }

    #[test]
    fn a_v1_only_build_refuses_a_v2_replica_and_an_option_it_lacks() {
        let a = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        check_process(&["v1"], "corral-replica", &a(&["serve", "--dir", "/d"])).unwrap();
        let e = check_process(&["v1"], "corral-replica", &a(&["serve-lvstore"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing v2") && e.contains(VERSION), "{e}");
        let e = check_process(
            &["v1"],
            "corral-engine",
            &a(&["serve", "--disable-revision-counter"]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("missing disable-revision-counter"), "{e}");
    }
}
