//! What can be wrong with an option's value.

use std::fmt;

/// Why an option's value was refused. Its `Display` is the message shown to users, complete
/// on its own: it quotes the value and says what is expected.
///
/// Texts are kept as written (or, for values the runtime checks, as [`format_duration`]
/// writes them) so that the message quotes what the user can find in their code.
///
/// [`format_duration`]: crate::format_duration
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OptionError {
    /// The handler name is empty.
    EmptyName,
    /// The handler name holds a character other than ASCII letters, digits, `_`, `.`, `-`.
    NameCharacter {
        /// The name as given.
        name: String,
        /// The first character that is not allowed.
        found: char,
    },
    /// The key template names no field, so every message would get the same key.
    KeyWithoutField {
        /// The template as given.
        template: String,
    },
    /// A `{` in the key template is never closed.
    UnclosedBrace {
        /// The template as given.
        template: String,
    },
    /// A `}` in the key template closes nothing.
    UnmatchedBrace {
        /// The template as given.
        template: String,
    },
    /// A `{…}` in the key template, or a part of its dotted path, is empty.
    EmptyField {
        /// The template as given.
        template: String,
    },
    /// A `{…}` in the key template holds a character that field names do not use.
    FieldCharacter {
        /// The template as given.
        template: String,
        /// The first character that is not allowed.
        found: char,
    },
    /// A duration is not an integer followed by `ms`, `s`, `m`, `h` or `d`.
    InvalidDuration {
        /// The duration as given.
        text: String,
    },
    /// A duration is more than `u64::MAX` milliseconds.
    DurationTooLarge {
        /// The duration as given.
        text: String,
    },
    /// A backoff is not of the form `BASE..CAP`.
    InvalidBackoff {
        /// The backoff as given.
        text: String,
    },
    /// A backoff's base is zero, so its delays would never grow.
    ZeroBackoffBase {
        /// The base as given.
        base: String,
    },
    /// A backoff's cap is shorter than its base.
    BackoffCapBelowBase {
        /// The base as given.
        base: String,
        /// The cap as given.
        cap: String,
    },
}

impl fmt::Display for OptionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptionError::EmptyName => f.write_str("the handler name must not be empty"),
            OptionError::NameCharacter { name, found } => write!(
                f,
                "invalid handler name {name:?}: {found:?} is not allowed; \
                 use letters, digits, `_`, `.` and `-`"
            ),
            OptionError::KeyWithoutField { template } => write!(
                f,
                "key template {template:?} names no field: every message would get the same key"
            ),
            OptionError::UnclosedBrace { template } => write!(
                f,
                "unclosed `{{` in key template {template:?} (write `{{{{` for a literal brace)"
            ),
            OptionError::UnmatchedBrace { template } => write!(
                f,
                "unmatched `}}` in key template {template:?} (write `}}}}` for a literal brace)"
            ),
            OptionError::EmptyField { template } => {
                write!(f, "empty field name in key template {template:?}")
            }
            OptionError::FieldCharacter { template, found } => write!(
                f,
                "unexpected {found:?} inside `{{…}}` in key template {template:?}: \
                 field names use letters, digits, `_` and `.`"
            ),
            OptionError::InvalidDuration { text } => write!(
                f,
                "invalid duration {text:?}: expected an integer followed by ms, s, m, h or d, \
                 e.g. \"500ms\", \"30s\", \"7d\""
            ),
            OptionError::DurationTooLarge { text } => {
                write!(f, "duration {text:?} is too large")
            }
            OptionError::InvalidBackoff { text } => write!(
                f,
                "invalid backoff {text:?}: expected \"BASE..CAP\", e.g. \"200ms..30s\""
            ),
            OptionError::ZeroBackoffBase { base } => write!(
                f,
                "backoff base {base:?} must be greater than zero: a zero base never grows"
            ),
            OptionError::BackoffCapBelowBase { base, cap } => {
                write!(f, "backoff cap {cap:?} is shorter than its base {base:?}")
            }
        }
    }
}

impl std::error::Error for OptionError {}
