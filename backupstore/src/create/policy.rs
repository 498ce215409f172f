//! The chain policy, pure: whether the next backup can be incremental on the newest completed one, and whether
//! the backup being made ends its chain. No IO: `create_locked` asks the source for the changed ranges only
//! when this says incremental.

use super::BackupMode;
use crate::config::{BackupConfig, FullReason};

/// What the policy decides before the source is asked for changes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decision<'a> {
    /// A full backup, for this reason.
    Full(FullReason),
    /// Incremental on this backup (the source may still find its snapshot gone: then a full follows).
    On(&'a BackupConfig),
}

/// Full or incremental on `last` (the volume's newest completed backup). `chain_ended` is the source's marker
/// (a backup was restored into the volume); `delta_max` is at least 1. `incremental` mode goes past delta-max,
/// never past a chain ended for another reason.
pub(super) fn decide<'a>(
    last: Option<&'a BackupConfig>,
    mode: BackupMode,
    incremental: bool,
    chain_ended: Option<&str>,
    delta_max: u32,
) -> Decision<'a> {
    let Some(l) = last else {
        return Decision::Full(if mode == BackupMode::Full {
            FullReason::Requested
        } else {
            FullReason::FirstBackup
        });
    };
    if mode == BackupMode::Full {
        return Decision::Full(FullReason::Requested);
    }
    if !incremental {
        return Decision::Full(FullReason::IncrementalDisabled);
    }
    if let Some(why) = chain_ended {
        return Decision::Full(FullReason::ChainEnded(why.to_owned()));
    }
    let past_delta_max =
        mode == BackupMode::Incremental && matches!(l.chain_end_reason, Some(FullReason::DeltaMaxReached(_)));
    if l.end_of_chain && !past_delta_max {
        return Decision::Full(
            l.chain_end_reason
                .clone()
                .unwrap_or_else(|| FullReason::ChainEnded(format!("backup {} ended its chain", l.name))),
        );
    }
    if mode == BackupMode::Auto && l.chain_position + 1 >= delta_max {
        return Decision::Full(FullReason::DeltaMaxReached(delta_max));
    }
    Decision::On(l)
}

/// Why the backup at `chain_position` ends its chain, if the next one will be full whatever happens in between.
pub(super) fn chain_end(incremental: bool, chain_position: u32, delta_max: u32) -> Option<FullReason> {
    if !incremental {
        Some(FullReason::IncrementalDisabled)
    } else if chain_position + 1 >= delta_max {
        Some(FullReason::DeltaMaxReached(delta_max))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backup(position: u32, end: Option<FullReason>) -> BackupConfig {
        BackupConfig {
            name: format!("b{position}"),
            chain_position: position,
            end_of_chain: end.is_some(),
            chain_end_reason: end,
            ..BackupConfig::default()
        }
    }

    #[test]
    fn the_first_backup_and_a_requested_one_are_full() {
        let l = backup(0, None);
        assert_eq!(
            decide(None, BackupMode::Auto, true, None, 5),
            Decision::Full(FullReason::FirstBackup)
        );
        assert_eq!(
            decide(None, BackupMode::Full, true, None, 5),
            Decision::Full(FullReason::Requested)
        );
        assert_eq!(
            decide(Some(&l), BackupMode::Full, true, None, 5),
            Decision::Full(FullReason::Requested)
        );
        assert_eq!(
            decide(Some(&l), BackupMode::Auto, true, None, 5),
            Decision::On(&l)
        );
    }

    #[test]
    fn auto_mode_starts_a_new_chain_at_delta_max_and_incremental_mode_goes_past_it() {
        let l = backup(3, None);
        assert_eq!(
            decide(Some(&l), BackupMode::Auto, true, None, 5),
            Decision::On(&l)
        );
        assert_eq!(
            decide(Some(&l), BackupMode::Auto, true, None, 4),
            Decision::Full(FullReason::DeltaMaxReached(4))
        );
        let ended = backup(3, Some(FullReason::DeltaMaxReached(4)));
        assert_eq!(
            decide(Some(&ended), BackupMode::Auto, true, None, 4),
            Decision::Full(FullReason::DeltaMaxReached(4))
        );
        assert_eq!(
            decide(Some(&ended), BackupMode::Incremental, true, None, 4),
            Decision::On(&ended)
        );
    }

    #[test]
    fn an_ended_chain_or_disabled_increments_force_a_full_even_in_incremental_mode() {
        let reverted = backup(1, Some(FullReason::ChainEnded("reverted".into())));
        assert_eq!(
            decide(Some(&reverted), BackupMode::Incremental, true, None, 9),
            Decision::Full(FullReason::ChainEnded("reverted".into()))
        );
        let l = backup(1, None);
        assert_eq!(
            decide(Some(&l), BackupMode::Incremental, true, Some("restored b7"), 9),
            Decision::Full(FullReason::ChainEnded("restored b7".into()))
        );
        assert_eq!(
            decide(Some(&l), BackupMode::Auto, false, None, 9),
            Decision::Full(FullReason::IncrementalDisabled)
        );
        let unexplained = BackupConfig {
            end_of_chain: true,
            ..backup(1, None)
        };
        assert_eq!(
            decide(Some(&unexplained), BackupMode::Auto, true, None, 9),
            Decision::Full(FullReason::ChainEnded("backup b1 ended its chain".into()))
        );
    }

    #[test]
    fn a_backup_ends_its_chain_when_the_next_would_pass_delta_max_or_increments_are_off() {
        assert_eq!(chain_end(true, 0, 1), Some(FullReason::DeltaMaxReached(1)));
        assert_eq!(chain_end(true, 2, 4), None);
        assert_eq!(chain_end(true, 3, 4), Some(FullReason::DeltaMaxReached(4)));
        assert_eq!(chain_end(false, 0, 4), Some(FullReason::IncrementalDisabled));
    }
}
