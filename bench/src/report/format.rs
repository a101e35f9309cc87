//! How figures are written in the report.

use crate::loadgen::LoadReport;
use crate::side::SideStats;

/// 12345.6 → "12,346".
pub fn thousands(x: f64) -> String {
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Milliseconds with three significant digits or so.
pub fn ms(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

pub fn answers(load: &LoadReport) -> String {
    let mut parts: Vec<String> = load
        .codes
        .iter()
        .map(|(k, v)| format!("{k}: {}", thousands(*v as f64)))
        .collect();
    parts.extend(
        load.errors
            .iter()
            .map(|(k, v)| format!("error {k}: {}", thousands(*v as f64))),
    );
    parts.join(", ")
}

pub fn side_cell(s: &SideStats) -> String {
    if s.queries == 0 {
        return "–".into();
    }
    format!("{} / {}", ms(s.latency.p50_ms), ms(s.latency.p99_ms))
}

pub fn verdict(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(ms(0.1234), "0.123");
        assert_eq!(ms(12.345), "12.3");
    }
}
