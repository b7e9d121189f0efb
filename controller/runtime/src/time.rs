//! The timestamps Kubernetes objects carry: RFC 3339 in UTC, to the second.

/// Now, as a condition's `lastTransitionTime` or a status timestamp wants it.
pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

pub fn now_unix() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// Seconds since the epoch of an RFC 3339 timestamp; `None` if it is not one.
pub fn parse_unix(ts: &str) -> Option<i64> {
    ts.parse::<jiff::Timestamp>().ok().map(|t| t.as_second())
}

pub fn unix_rfc3339(secs: i64) -> String {
    jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_rfc3339() {
        assert_eq!(unix_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(parse_unix("1970-01-01T00:01:40Z"), Some(100));
        assert_eq!(parse_unix("yesterday"), None);
        let now = now_rfc3339();
        assert!(parse_unix(&now).unwrap() - now_unix() <= 1, "{now}");
    }
}
