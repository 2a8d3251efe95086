//! Header names the transport reads and writes.
//!
//! Retry copies carry [`ATTEMPT`], [`DUE_AT`], [`RETRY_GROUP`] and the `x-original-*`
//! headers; dead-letter records carry [`ATTEMPT`] (if the record had one), the reason,
//! handler, key, attempts, error and `x-original-*` headers, on top of the original record's
//! key, value and headers. Values are UTF-8 text.

/// The framework's own headers, the same on every transport.
pub use consumer_core::header_names::{
    ATTEMPT, ATTEMPTS, DEAD_LETTER_REASON, ERROR, FIRST_FAILURE, HANDLER, KEY, MAX_ERROR_LEN,
};

/// When a retry copy is due, in milliseconds since the Unix epoch.
pub const DUE_AT: &str = "x-due-at";
/// The consumer group that wrote a retry copy. Several groups may share a topic and so its
/// retry topic; each consumes only its own copies and skips (commits past) the others'.
pub const RETRY_GROUP: &str = "x-retry-group";

/// The topic the record was first consumed from (not the retry topic).
pub const ORIGINAL_TOPIC: &str = "x-original-topic";
/// Its partition there.
pub const ORIGINAL_PARTITION: &str = "x-original-partition";
/// Its offset there.
pub const ORIGINAL_OFFSET: &str = "x-original-offset";

/// Headers that say where a message first came from and when it first failed. Only this
/// transport's own retry copies (on a retry topic, written by this group) carry them on;
/// on any other record they were supplied by a producer and are dropped from its copies
/// (and the origin written afresh), so a dead letter's origin is always the framework's.
pub(crate) const ORIGIN: &[&str] = &[
    ORIGINAL_TOPIC,
    ORIGINAL_PARTITION,
    ORIGINAL_OFFSET,
    FIRST_FAILURE,
];

/// Headers written by the transport, replaced (not duplicated) when a copy is written again.
pub(crate) const MANAGED: &[&str] = &[
    ATTEMPT,
    DUE_AT,
    RETRY_GROUP,
    DEAD_LETTER_REASON,
    HANDLER,
    KEY,
    ATTEMPTS,
    ERROR,
];

/// `s` cut to at most `max` bytes at a character boundary, marked with `…` when cut.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_are_cut_at_a_char_boundary() {
        assert_eq!(truncate("short", 10), "short");
        let cut = truncate(&"é".repeat(5000), MAX_ERROR_LEN);
        assert!(
            cut.len() <= MAX_ERROR_LEN && cut.ends_with('…'),
            "{}",
            cut.len()
        );
    }
}
