//! Kubernetes resource quantities ("512Mi", "1G", "1.5Gi", "100m") as byte counts.

/// Parses a memory-style quantity into bytes. Fractions are allowed where they give whole bytes.
pub fn parse_bytes(q: &str) -> Result<u64, String> {
    let s = q.trim();
    if s.is_empty() {
        return Err("empty quantity".into());
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let mult: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        _ => {
            return Err(format!(
                "{q:?}: unknown suffix {suffix:?} (accepted: Ki, Mi, Gi, Ti, Pi, k, M, G, T, P)"
            ))
        }
    };
    if num.is_empty() || num.matches('.').count() > 1 {
        return Err(format!(
            "{q:?} is not a number with an optional suffix such as 512Mi or 2Gi"
        ));
    }
    let v: f64 = num.parse().map_err(|_| format!("{q:?} is not a number"))?;
    let bytes = v * mult;
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(format!("{q:?} is too large"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("{q:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubernetes_quantities() {
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("2Gi"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("128"), Ok(128));
        assert!(parse_bytes("12Zi").unwrap_err().contains("unknown suffix"));
        assert!(parse_bytes("Mi").is_err());
        assert!(parse_bytes("1.2.3Mi").is_err());
        assert!(parse_bytes("0.3").unwrap_err().contains("whole number"));
    }
}
