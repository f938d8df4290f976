//! The checks `keys list` makes of its filters before any call, each refusal in the flags' own
//! words (exit 2): instants in RFC 3339 with a zone, and the combinations the API refuses (a
//! completion time selects completed keys, a claim time keys in progress; a range must not be
//! empty). The ranges of `--limit` and `--batch-size` are clap's (`config::admin`).

use crate::config::admin::StateArg;

use super::Failure;

/// The time filters of `keys list`, as given.
pub(super) struct TimeFilters<'a> {
    pub state: Option<StateArg>,
    pub completed_after: &'a Option<String>,
    pub completed_before: &'a Option<String>,
    pub claimed_after: &'a Option<String>,
    pub claimed_before: &'a Option<String>,
}

/// The filters checked: each instant parsed, no two that contradict each other.
pub(super) fn check_filters(filters: &TimeFilters<'_>) -> Result<(), Failure> {
    let completed = [
        ("completed-after", filters.completed_after),
        ("completed-before", filters.completed_before),
    ];
    let claimed = [
        ("claimed-after", filters.claimed_after),
        ("claimed-before", filters.claimed_before),
    ];
    for (flag, value) in completed.iter().chain(&claimed) {
        instant_flag(flag, (*value).clone())?;
    }
    let given = |flags: &[(&'static str, &Option<String>)]| {
        flags
            .iter()
            .find(|(_, value)| value.is_some())
            .map(|(flag, _)| *flag)
    };
    let state_name = match filters.state {
        Some(StateArg::InProgress) => Some("in-progress"),
        Some(StateArg::Stuck) => Some("stuck"),
        Some(StateArg::Released) => Some("released"),
        _ => None,
    };
    if let (Some(flag), Some(state)) = (given(&completed), state_name) {
        return Err(Failure::Usage(format!(
            "--{flag} selects completed keys, and --state {state} keys in progress: give one"
        )));
    }
    if let Some(flag) = given(&claimed) {
        if filters.state == Some(StateArg::Completed) {
            return Err(Failure::Usage(format!(
                "--{flag} selects keys in progress, and --state completed completed keys: give \
                 one"
            )));
        }
        if let Some(other) = given(&completed) {
            return Err(Failure::Usage(format!(
                "--{flag} selects keys in progress, and --{other} completed keys: give one"
            )));
        }
    }
    for [(after_flag, after), (before_flag, before)] in [completed, claimed] {
        if let (Some(after), Some(before)) = (
            instant_flag(after_flag, after.clone())?,
            instant_flag(before_flag, before.clone())?,
        ) && (after.seconds, after.nanos) >= (before.seconds, before.nanos)
        {
            return Err(Failure::Usage(format!(
                "--{after_flag} must be earlier than --{before_flag}: no key is both"
            )));
        }
    }
    Ok(())
}

/// `value` of `--flag` as a timestamp: RFC 3339, with a zone (`Z` or an offset); a time
/// without one is refused with the hint to add it.
pub(super) fn instant_flag(
    flag: &str,
    value: Option<String>,
) -> Result<Option<prost_types::Timestamp>, Failure> {
    let Some(value) = value else {
        return Ok(None);
    };
    let parsed = chrono::DateTime::parse_from_rfc3339(&value).map_err(|error| {
        let zoneless = ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"]
            .iter()
            .any(|format| chrono::NaiveDateTime::parse_from_str(&value, format).is_ok());
        let hint = if zoneless {
            format!(" (it has no zone: add one, e.g. {value}Z for UTC)")
        } else {
            String::from(" (e.g. 2026-12-04T03:00:00Z)")
        };
        Failure::Usage(format!(
            "--{flag}: {value:?} is not an RFC 3339 instant: {error}{hint}"
        ))
    })?;
    let at = parsed.to_utc();
    Ok(Some(prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: i32::try_from(at.timestamp_subsec_nanos()).unwrap_or(0),
    }))
}
