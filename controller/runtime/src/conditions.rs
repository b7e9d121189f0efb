//! Conditions as the API conventions ask: one per type, and `lastTransitionTime` moves only
//! when the status does.

use api::Condition;

use crate::time::now_rfc3339;

/// Sets a condition, keeping its lastTransitionTime when the status does not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: Option<&str>,
    message: Option<String>,
) {
    let status = if status { "True" } else { "False" }.to_string();
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Some(now_rfc3339());
            }
            c.status = status;
            c.reason = reason.map(str::to_string);
            c.message = message;
        }
        None => conditions.push(Condition {
            type_: type_.into(),
            status,
            reason: reason.map(str::to_string),
            message,
            last_transition_time: Some(now_rfc3339()),
            last_probe_time: None,
        }),
    }
}

pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transition_time_moves_only_with_the_status() {
        let mut c = vec![];
        set_condition(&mut c, "Ready", false, Some("Starting"), None);
        c[0].last_transition_time = Some("earlier".into());
        set_condition(&mut c, "Ready", false, Some("Still"), Some("m".into()));
        assert_eq!(c[0].last_transition_time.as_deref(), Some("earlier"));
        assert_eq!(c[0].reason.as_deref(), Some("Still"));
        set_condition(&mut c, "Ready", true, None, None);
        assert_ne!(c[0].last_transition_time.as_deref(), Some("earlier"));
        assert_eq!((c.len(), c[0].status.as_str()), (1, "True"));
        remove_condition(&mut c, "Ready");
        assert!(c.is_empty());
    }
}
