//! Checks on option values, as plain functions from the literal's text to a value or the
//! reason it is wrong. `valid` puts the reason on the literal's span.

/// Milliseconds per unit, in the order the units are listed in error messages.
const UNITS: &[(&str, u64)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
];

/// A duration such as `"500ms"`, `"30s"`, `"5m"`, `"1h"` or `"7d"`, in milliseconds.
///
/// Strict on purpose: no spaces, signs, fractions or compound forms, so a value reads the
/// same to everyone who sees it.
pub(crate) fn parse_duration(text: &str) -> Result<u64, String> {
    let invalid = || {
        format!(
            "invalid duration {text:?}: expected an integer followed by ms, s, m, h or d, \
             e.g. \"500ms\", \"30s\", \"7d\""
        )
    };
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(invalid());
    }
    let Some(&(_, per_unit)) = UNITS.iter().find(|(name, _)| *name == unit) else {
        return Err(invalid());
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(per_unit))
        .ok_or_else(|| format!("duration {text:?} is too large"))
}

/// A backoff range `"BASE..CAP"`, e.g. `"200ms..30s"`, in milliseconds: base > 0, cap ≥ base.
pub(crate) fn parse_backoff(text: &str) -> Result<(u64, u64), String> {
    let Some((base, cap)) = text.split_once("..") else {
        return Err(format!(
            "invalid backoff {text:?}: expected \"BASE..CAP\", e.g. \"200ms..30s\""
        ));
    };
    let base_ms = parse_duration(base)?;
    let cap_ms = parse_duration(cap)?;
    if base_ms == 0 {
        return Err(format!(
            "backoff base {base:?} must be greater than zero: a zero base never grows"
        ));
    }
    if cap_ms < base_ms {
        return Err(format!(
            "backoff cap {cap:?} is shorter than its base {base:?}"
        ));
    }
    Ok((base_ms, cap_ms))
}

/// A handler name: `[A-Za-z0-9_.-]+`. It is the identity stored in the inbox and shows up in
/// logs and metrics, so it stays plain.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the handler name must not be empty".to_owned());
    }
    match name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        Some(c) => Err(format!(
            "invalid handler name {name:?}: {c:?} is not allowed; use letters, digits, `_`, `.` and `-`"
        )),
        None => Ok(()),
    }
}

/// A key template such as `"invoice-{order_id}"`: `{field}` or `{a.b}` takes a field,
/// `{{` and `}}` are literal braces, and at least one field is named.
///
/// Kept in step with `consumer_core::key::KeyTemplate::parse_inner`, which the runtime uses
/// (this crate cannot depend on consumer-core: consumer-core depends on it), so that a
/// template the macro accepts never fails when the worker starts.
pub(crate) fn check_key_template(template: &str) -> Result<(), String> {
    let mut fields = 0_usize;
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
            }
            '{' => {
                let mut field = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_alphanumeric() || c == '_' || c == '.' => {
                            field.push(c);
                        }
                        Some(c) => {
                            return Err(format!(
                                "unexpected {c:?} inside `{{…}}` in key template {template:?}: \
                                 field names use letters, digits, `_` and `.`"
                            ))
                        }
                        None => {
                            return Err(format!(
                                "unclosed `{{` in key template {template:?} (write `{{{{` for a literal brace)"
                            ))
                        }
                    }
                }
                if field.split('.').any(str::is_empty) {
                    return Err(format!("empty field name in key template {template:?}"));
                }
                fields += 1;
            }
            '}' => {
                return Err(format!(
                    "unmatched `}}` in key template {template:?} (write `}}}}` for a literal brace)"
                ))
            }
            _ => {}
        }
    }
    if fields == 0 {
        return Err(format!(
            "key template {template:?} names no field: every message would get the same key"
        ));
    }
    Ok(())
}

/// `consumer_core::ConflictPolicy`, as named in the attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConflictPolicy {
    /// `"dead_letter"`.
    DeadLetter,
    /// `"skip"`.
    Skip,
}

/// `"dead_letter"` or `"skip"`.
pub(crate) fn parse_conflict_policy(text: &str) -> Result<ConflictPolicy, String> {
    match text {
        "dead_letter" => Ok(ConflictPolicy::DeadLetter),
        "skip" => Ok(ConflictPolicy::Skip),
        _ => Err(format!(
            "unknown conflict policy {text:?}: expected \"dead_letter\" or \"skip\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_every_unit() {
        assert_eq!(parse_duration("0ms"), Ok(0));
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("2s"), Ok(2_000));
        assert_eq!(parse_duration("5m"), Ok(300_000));
        assert_eq!(parse_duration("1h"), Ok(3_600_000));
        assert_eq!(parse_duration("7d"), Ok(604_800_000));
        assert_eq!(parse_duration("007s"), Ok(7_000));
    }

    #[test]
    fn durations_reject_other_forms() {
        for bad in [
            "", "5", "ms", "5x", "5 s", " 5s", "5s ", "-5s", "+5s", "1.5s", "5S", "5sec", "1h30m",
            "5mss", "٣s",
        ] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.starts_with("invalid duration"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn durations_that_overflow_are_rejected() {
        assert!(parse_duration("99999999999999999999ms")
            .expect_err("u64 overflow")
            .contains("too large"));
        assert!(parse_duration("999999999999999d")
            .expect_err("multiplication overflow")
            .contains("too large"));
        assert_eq!(parse_duration(&format!("{}ms", u64::MAX)), Ok(u64::MAX));
    }

    #[test]
    fn backoff_ranges() {
        assert_eq!(parse_backoff("200ms..30s"), Ok((200, 30_000)));
        assert_eq!(parse_backoff("1s..1s"), Ok((1_000, 1_000)));
        assert_eq!(parse_backoff("1m..1d"), Ok((60_000, 86_400_000)));
    }

    #[test]
    fn backoff_rejects_bad_ranges() {
        let err = |s: &str| parse_backoff(s).expect_err(s);
        assert!(err("200ms").contains("expected \"BASE..CAP\""));
        assert!(err("200ms-30s").contains("expected \"BASE..CAP\""));
        assert!(err("0ms..1s").contains("greater than zero"));
        assert!(err("30s..200ms").contains("shorter than its base"));
        assert!(err("x..1s").starts_with("invalid duration \"x\""));
        assert!(err("1s..").starts_with("invalid duration \"\""));
        assert!(err("1s...2s").starts_with("invalid duration \".2s\""));
        assert!(err("1s..2s..3s").starts_with("invalid duration \"2s..3s\""));
    }

    #[test]
    fn names() {
        for ok in ["send_invoice", "billing.send-invoice", "v2", "A.b_c-9"] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        assert!(check_name("")
            .expect_err("empty")
            .contains("must not be empty"));
        for (bad, c) in [
            ("send invoice", "' '"),
            ("a/b", "'/'"),
            ("größe", "'ö'"),
            ("x:y", "':'"),
        ] {
            let err = check_name(bad).expect_err(bad);
            assert!(err.contains(c), "{bad:?}: {err}");
        }
    }

    #[test]
    fn key_templates_accepted() {
        for ok in [
            "invoice-{order_id}",
            "{a.b.c}",
            "{x}{y}",
            "{{literal}}-{id}",
            "{id}-{{",
            "}}{id}",
            "{A_1.b2}",
        ] {
            assert_eq!(check_key_template(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn key_templates_rejected() {
        let err = |s: &str| check_key_template(s).expect_err(s);
        assert!(err("invoice").contains("names no field"));
        assert!(err("").contains("names no field"));
        assert!(err("{{order_id}}").contains("names no field"));
        assert!(err("invoice-{order_id").contains("unclosed `{`"));
        assert!(err("invoice-{").contains("unclosed `{`"));
        assert!(err("invoice-order_id}").contains("unmatched `}`"));
        assert!(err("{id}}").contains("unmatched `}`"));
        assert!(err("{}").contains("empty field name"));
        assert!(err("{a..b}").contains("empty field name"));
        assert!(err("{.a}").contains("empty field name"));
        assert!(err("{a.}").contains("empty field name"));
        assert!(err("{order id}").contains("unexpected ' '"));
        assert!(err("{a-b}").contains("unexpected '-'"));
        assert!(err("{a{b}}").contains("unexpected '{'"));
    }

    #[test]
    fn conflict_policies() {
        assert_eq!(
            parse_conflict_policy("dead_letter"),
            Ok(ConflictPolicy::DeadLetter)
        );
        assert_eq!(parse_conflict_policy("skip"), Ok(ConflictPolicy::Skip));
        for bad in ["DeadLetter", "dead-letter", "Skip", ""] {
            assert!(parse_conflict_policy(bad)
                .expect_err(bad)
                .contains("expected \"dead_letter\" or \"skip\""));
        }
    }
}
