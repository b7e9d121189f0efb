//! Kubernetes resource quantities as byte counts, in every form the API server accepts
//! (`k8s.io/apimachinery/pkg/api/resource`): a signed decimal number (`1`, `1.5`, `.5`) with a
//! binary suffix (`Ki Mi Gi Ti Pi Ei`), a decimal suffix (`n u m k M G T P E`, or none), or a
//! decimal exponent (`1e9`, `5E3`, `2e-3`). Exact integer arithmetic, no floats: `1.1Gi` is
//! exactly what Kubernetes makes of it. A fraction of a byte is rounded up, as Kubernetes'
//! `Quantity.Value()` does.

/// The forms, for error messages.
pub const ACCEPTED: &str = "a number with an optional suffix: binary Ki, Mi, Gi, Ti, Pi, Ei \
                            (512Mi, 1.5Gi), decimal k, M, G, T, P, E (1024M, 2G), an exponent \
                            (1e9), or plain bytes";

/// Parses a quantity into bytes (rounded up to a whole byte).
pub fn parse_bytes(q: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("{q:?} {why}; accepted: {ACCEPTED}");
    let s = q.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(bad("is negative"));
    }
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(end);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(bad("is not a number"));
    }
    // value = digits × 10^(exp10) × 2^(exp2)
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err(bad("has too many digits"));
    }
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| bad("is not a number"))?
    };
    let mut exp10: i32 = -(frac.len() as i32);
    let mut exp2: u32 = 0;
    match suffix {
        "" => {}
        "Ki" => exp2 = 10,
        "Mi" => exp2 = 20,
        "Gi" => exp2 = 30,
        "Ti" => exp2 = 40,
        "Pi" => exp2 = 50,
        "Ei" => exp2 = 60,
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        other => {
            let e = other
                .strip_prefix('e')
                .or_else(|| other.strip_prefix('E'))
                .and_then(|e| e.parse::<i32>().ok())
                .filter(|e| e.abs() <= 40)
                .ok_or_else(|| bad(&format!("has an unknown suffix {other:?}")))?;
            exp10 += e;
        }
    }
    let too_large = || bad("is too large");
    let mut v = mantissa.checked_mul(1u128 << exp2).ok_or_else(too_large)?;
    if exp10 >= 0 {
        let p = 10u128.checked_pow(exp10 as u32).ok_or_else(too_large)?;
        v = v.checked_mul(p).ok_or_else(too_large)?;
    } else {
        let p = 10u128.checked_pow((-exp10) as u32).ok_or_else(too_large)?;
        v = v.div_ceil(p);
    }
    u64::try_from(v).map_err(|_| too_large())
}

pub const MIB: u64 = 1 << 20;

/// Guest memory in whole MiB, the VMM's granularity: a size that is not a whole MiB (say the
/// decimal `1024M`, 976.56 MiB) is rounded up, so the guest never gets less than it asked for.
pub fn guest_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_kubernetes_quantities() {
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("2Gi"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("1024M"), Ok(1_024_000_000));
        assert_eq!(parse_bytes("128"), Ok(128));
        assert_eq!(parse_bytes("1e9"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("5E3"), Ok(5000));
        assert_eq!(parse_bytes("+1Ki"), Ok(1024));
        assert_eq!(parse_bytes(".5Ki"), Ok(512));
        assert_eq!(
            parse_bytes("1.1Gi"),
            Ok(1_181_116_007),
            "rounded up, as Kubernetes"
        );
        assert_eq!(parse_bytes("0.3"), Ok(1), "a fraction of a byte rounds up");
        assert_eq!(parse_bytes("1500m"), Ok(2));
        assert_eq!(parse_bytes("12e-1"), Ok(2));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_bytes("12Zi").unwrap_err().contains("unknown suffix"));
        assert!(parse_bytes("Mi").unwrap_err().contains("not a number"));
        assert!(parse_bytes("1.2.3Mi").is_err());
        assert!(parse_bytes("-1Gi").unwrap_err().contains("negative"));
        assert!(parse_bytes("20Ei").unwrap_err().contains("too large"));
        assert!(parse_bytes("1Gb").unwrap_err().contains("accepted"));
    }

    #[test]
    fn guest_memory_rounds_up_to_whole_mib() {
        assert_eq!(guest_mib(1_024_000_000), 977);
        assert_eq!(guest_mib(512 << 20), 512);
        assert_eq!(guest_mib((512 << 20) + 1), 513);
    }

    proptest! {
        #[test]
        fn any_input_parses_or_is_refused(s in "\\PC{0,24}") {
            let _ = parse_bytes(&s);
        }

        #[test]
        fn binary_and_decimal_forms_agree(n in 0u64..1_000_000) {
            prop_assert_eq!(parse_bytes(&format!("{n}Ki")), Ok(n * 1024));
            prop_assert_eq!(parse_bytes(&format!("{n}k")), Ok(n * 1000));
            prop_assert_eq!(parse_bytes(&format!("{n}e3")), Ok(n * 1000));
        }
    }
}
