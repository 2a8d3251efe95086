//! Durations as options write them: `"500ms"`, `"30s"`, `"5m"`, `"1h"`, `"7d"`.

use std::time::Duration;

use crate::OptionError;

/// Milliseconds per unit, largest first: [`format_duration`] takes the first that fits.
const UNITS: &[(&str, u64)] = &[
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// Parses a duration: an integer followed by `ms`, `s`, `m`, `h` or `d`.
///
/// Strict on purpose: no spaces, signs, fractions or compound forms (`"1h30m"`), so a value
/// reads the same to everyone who sees it. The result is at most `u64::MAX` milliseconds, so
/// it always fits `Duration::from_millis`.
///
/// ```
/// # use std::time::Duration;
/// assert_eq!(consumer_options::parse_duration("5m"), Ok(Duration::from_secs(300)));
/// assert!(consumer_options::parse_duration("1.5s").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, OptionError> {
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let per_unit = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .filter(|_| !digits.is_empty());
    let Some(&(_, per_unit)) = per_unit else {
        return Err(OptionError::InvalidDuration {
            text: text.to_owned(),
        });
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(per_unit))
        .map(Duration::from_millis)
        .ok_or_else(|| OptionError::DurationTooLarge {
            text: text.to_owned(),
        })
}

/// Writes a duration the way [`parse_duration`] reads it, in the largest unit that divides it
/// exactly: 300 seconds is `"5m"`, 90 seconds `"90s"`, zero `"0s"`.
///
/// Every duration `parse_duration` accepts comes back the same through this function.
/// A duration that is not a whole number of milliseconds has no such form; it is written
/// as `Duration`'s `Debug` does (`"1.5ms"`, `"250µs"`), which still reads well in a message.
///
/// ```
/// # use std::time::Duration;
/// assert_eq!(consumer_options::format_duration(Duration::from_secs(7 * 86_400)), "7d");
/// assert_eq!(consumer_options::format_duration(Duration::from_millis(1_500)), "1500ms");
/// ```
pub fn format_duration(duration: Duration) -> String {
    if duration.is_zero() {
        return "0s".to_owned();
    }
    if !duration.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{duration:?}");
    }
    let millis = duration.as_millis();
    UNITS
        .iter()
        .find(|&&(_, per_unit)| millis.is_multiple_of(u128::from(per_unit)))
        .map_or_else(
            || format!("{millis}ms"),
            |&(unit, per_unit)| format!("{}{unit}", millis / u128::from(per_unit)),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn every_unit_parses() {
        assert_eq!(parse_duration("0ms"), Ok(ms(0)));
        assert_eq!(parse_duration("500ms"), Ok(ms(500)));
        assert_eq!(parse_duration("2s"), Ok(ms(2_000)));
        assert_eq!(parse_duration("5m"), Ok(ms(300_000)));
        assert_eq!(parse_duration("1h"), Ok(ms(3_600_000)));
        assert_eq!(parse_duration("7d"), Ok(ms(604_800_000)));
        assert_eq!(parse_duration("007s"), Ok(ms(7_000)));
    }

    #[test]
    fn other_forms_are_refused() {
        for bad in [
            "", "5", "ms", "5x", "5 s", " 5s", "5s ", "-5s", "+5s", "1.5s", "5S", "5sec", "1h30m",
            "5mss", "٣s", "s5",
        ] {
            assert_eq!(
                parse_duration(bad),
                Err(OptionError::InvalidDuration {
                    text: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_duration("30 seconds")
                .expect_err("spaces")
                .to_string(),
            "invalid duration \"30 seconds\": expected an integer followed by ms, s, m, h or d, \
             e.g. \"500ms\", \"30s\", \"7d\""
        );
    }

    #[test]
    fn more_than_u64_milliseconds_is_too_large() {
        let too_large = |text: &str| {
            Err(OptionError::DurationTooLarge {
                text: text.to_owned(),
            })
        };
        // Too many digits for a u64.
        assert_eq!(
            parse_duration("99999999999999999999ms"),
            too_large("99999999999999999999ms")
        );
        // A u64, but not once multiplied by the unit.
        assert_eq!(
            parse_duration("999999999999999d"),
            too_large("999999999999999d")
        );
        assert_eq!(parse_duration(&format!("{}ms", u64::MAX)), Ok(ms(u64::MAX)));
        assert_eq!(
            parse_duration("999999999999999d")
                .expect_err("too large")
                .to_string(),
            "duration \"999999999999999d\" is too large"
        );
    }

    #[test]
    fn formats_in_the_largest_exact_unit() {
        assert_eq!(format_duration(Duration::ZERO), "0s");
        assert_eq!(format_duration(ms(1)), "1ms");
        assert_eq!(format_duration(ms(200)), "200ms");
        assert_eq!(format_duration(ms(1_500)), "1500ms");
        assert_eq!(format_duration(ms(30_000)), "30s");
        assert_eq!(format_duration(ms(90_000)), "90s");
        assert_eq!(format_duration(ms(300_000)), "5m");
        assert_eq!(format_duration(ms(3_600_000)), "1h");
        assert_eq!(format_duration(ms(86_400_000 * 7)), "7d");
        assert_eq!(format_duration(ms(86_400_000 + 3_600_000)), "25h");
        assert_eq!(format_duration(ms(u64::MAX)), format!("{}ms", u64::MAX));
    }

    #[test]
    fn finer_than_a_millisecond_is_written_as_debug_does() {
        assert_eq!(format_duration(Duration::from_micros(1_500)), "1.5ms");
        assert_eq!(format_duration(Duration::from_micros(250)), "250µs");
        assert_eq!(format_duration(Duration::from_nanos(1)), "1ns");
    }

    #[test]
    fn formatting_round_trips_through_parsing() {
        for text in ["0s", "1ms", "999ms", "1s", "61s", "2m", "23h", "1d", "365d"] {
            let duration = parse_duration(text).expect(text);
            assert_eq!(format_duration(duration), text);
            assert_eq!(parse_duration(&format_duration(duration)), Ok(duration));
        }
        // Beyond u64 milliseconds a duration has a form, but not one that parses.
        assert!(parse_duration(&format_duration(Duration::MAX)).is_err());
    }
}
