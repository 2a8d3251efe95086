//! Backoff ranges: `"200ms..30s"`.

use std::fmt;
use std::time::Duration;

use crate::{format_duration, parse_duration, OptionError};

/// The bounds of an exponential backoff: the first delay (`base`) and the largest (`cap`).
///
/// The bounds rule: the base is greater than zero (a zero base never grows) and the cap is
/// at least the base. Every `BackoffRange` satisfies it, however it was made. `Display`
/// writes the `"BASE..CAP"` form that [`BackoffRange::parse`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackoffRange {
    base: Duration,
    cap: Duration,
}

impl BackoffRange {
    /// Checks the bounds rule on durations given in code; the error writes them as
    /// [`format_duration`] does.
    ///
    /// ```
    /// # use std::time::Duration;
    /// use consumer_options::BackoffRange;
    ///
    /// let range = BackoffRange::new(Duration::from_millis(200), Duration::from_secs(30));
    /// assert_eq!(range.map(|r| r.to_string()), Ok("200ms..30s".to_owned()));
    /// assert!(BackoffRange::new(Duration::ZERO, Duration::from_secs(1)).is_err());
    /// ```
    pub fn new(base: Duration, cap: Duration) -> Result<Self, OptionError> {
        if base.is_zero() {
            return Err(OptionError::ZeroBackoffBase {
                base: format_duration(base),
            });
        }
        if cap < base {
            return Err(OptionError::BackoffCapBelowBase {
                base: format_duration(base),
                cap: format_duration(cap),
            });
        }
        Ok(BackoffRange { base, cap })
    }

    /// Parses `"BASE..CAP"`, two [`parse_duration`] durations, and checks the bounds rule;
    /// the error quotes the parts as written.
    ///
    /// ```
    /// # use std::time::Duration;
    /// use consumer_options::BackoffRange;
    ///
    /// let range = BackoffRange::parse("1s..5m").expect("a valid range");
    /// assert_eq!((range.base(), range.cap()), (Duration::from_secs(1), Duration::from_secs(300)));
    /// assert!(BackoffRange::parse("30s..1s").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Self, OptionError> {
        let Some((base_text, cap_text)) = text.split_once("..") else {
            return Err(OptionError::InvalidBackoff {
                text: text.to_owned(),
            });
        };
        let base = parse_duration(base_text)?;
        let cap = parse_duration(cap_text)?;
        if base.is_zero() {
            return Err(OptionError::ZeroBackoffBase {
                base: base_text.to_owned(),
            });
        }
        if cap < base {
            return Err(OptionError::BackoffCapBelowBase {
                base: base_text.to_owned(),
                cap: cap_text.to_owned(),
            });
        }
        Ok(BackoffRange { base, cap })
    }

    /// The first delay.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The largest delay.
    pub fn cap(&self) -> Duration {
        self.cap
    }
}

impl fmt::Display for BackoffRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}..{}",
            format_duration(self.base),
            format_duration(self.cap)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn range(base: u64, cap: u64) -> Result<(Duration, Duration), OptionError> {
        Ok((ms(base), ms(cap)))
    }

    fn parse(text: &str) -> Result<(Duration, Duration), OptionError> {
        BackoffRange::parse(text).map(|r| (r.base(), r.cap()))
    }

    #[test]
    fn ranges_parse() {
        assert_eq!(parse("200ms..30s"), range(200, 30_000));
        assert_eq!(parse("1s..1s"), range(1_000, 1_000));
        assert_eq!(parse("1m..1d"), range(60_000, 86_400_000));
        assert_eq!(parse("1ms..1000ms"), range(1, 1_000));
    }

    #[test]
    fn a_range_needs_two_dots() {
        for bad in ["200ms", "200ms-30s", "200ms.30s", ""] {
            assert_eq!(
                parse(bad),
                Err(OptionError::InvalidBackoff {
                    text: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse("200ms").expect_err("one part").to_string(),
            "invalid backoff \"200ms\": expected \"BASE..CAP\", e.g. \"200ms..30s\""
        );
    }

    #[test]
    fn each_part_is_a_duration() {
        let invalid = |text: &str| {
            Err(OptionError::InvalidDuration {
                text: text.to_owned(),
            })
        };
        assert_eq!(parse("x..1s"), invalid("x"));
        assert_eq!(parse("1s.."), invalid(""));
        assert_eq!(parse("..1s"), invalid(""));
        // Split at the first `..`: what follows is the cap, as written.
        assert_eq!(parse("1s...2s"), invalid(".2s"));
        assert_eq!(parse("1s..2s..3s"), invalid("2s..3s"));
        assert_eq!(
            parse("1s..99999999999999999999ms"),
            Err(OptionError::DurationTooLarge {
                text: "99999999999999999999ms".to_owned()
            })
        );
    }

    #[test]
    fn the_bounds_rule_quotes_the_parts_as_written() {
        assert_eq!(
            parse("0ms..1s"),
            Err(OptionError::ZeroBackoffBase {
                base: "0ms".to_owned()
            })
        );
        // A zero base is reported even when the cap is zero too.
        assert_eq!(
            parse("0s..0s"),
            Err(OptionError::ZeroBackoffBase {
                base: "0s".to_owned()
            })
        );
        assert_eq!(
            parse("30s..200ms"),
            Err(OptionError::BackoffCapBelowBase {
                base: "30s".to_owned(),
                cap: "200ms".to_owned()
            })
        );
        assert_eq!(
            parse("60s..1m"),
            Ok((Duration::from_secs(60), Duration::from_secs(60)))
        );
        assert_eq!(
            parse("30s..200ms").expect_err("cap below base").to_string(),
            "backoff cap \"200ms\" is shorter than its base \"30s\""
        );
        assert_eq!(
            parse("0ms..1s").expect_err("zero base").to_string(),
            "backoff base \"0ms\" must be greater than zero: a zero base never grows"
        );
    }

    #[test]
    fn the_bounds_rule_on_durations_from_code() {
        assert_eq!(
            BackoffRange::new(ms(200), ms(30_000)).map(|r| (r.base(), r.cap())),
            range(200, 30_000)
        );
        assert_eq!(
            BackoffRange::new(ms(5), ms(5)).map(|r| (r.base(), r.cap())),
            range(5, 5)
        );
        // Finer than a millisecond is allowed in code.
        assert!(BackoffRange::new(Duration::from_nanos(1), Duration::from_nanos(1)).is_ok());
        assert_eq!(
            BackoffRange::new(Duration::ZERO, ms(1_000)),
            Err(OptionError::ZeroBackoffBase {
                base: "0s".to_owned()
            })
        );
        assert_eq!(
            BackoffRange::new(ms(2_000), Duration::from_micros(1_500)),
            Err(OptionError::BackoffCapBelowBase {
                base: "2s".to_owned(),
                cap: "1.5ms".to_owned()
            })
        );
    }

    #[test]
    fn display_writes_what_parse_reads() {
        for text in ["200ms..30s", "1s..1s", "1m..1d", "5m..90m"] {
            let range = BackoffRange::parse(text).expect(text);
            assert_eq!(range.to_string(), text);
            assert_eq!(BackoffRange::parse(&range.to_string()), Ok(range));
        }
        // Written in the largest exact unit, whatever unit was parsed.
        assert_eq!(
            BackoffRange::parse("60000ms..120s").map(|r| r.to_string()),
            Ok("1m..2m".to_owned())
        );
    }
}
