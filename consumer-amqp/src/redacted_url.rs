//! The broker URL, shown only without its credentials.

use std::fmt;

/// A broker URL that can only be displayed without its credentials.
///
/// `Display` and `Debug` print `amqp://***@host:5672/vhost?query`: the user name and
/// password are replaced, whatever they contain. Every log line and error of this crate
/// shows URLs through this type.
#[derive(Clone, PartialEq, Eq)]
pub struct RedactedUrl(String);

impl RedactedUrl {
    /// Wraps `url`; it is only ever shown redacted.
    pub fn new(url: impl Into<String>) -> Self {
        RedactedUrl(url.into())
    }

    /// The URL with its credentials, for connecting. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl fmt::Debug for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedactedUrl({:?})", redact(&self.0))
    }
}

/// `scheme://user:pass@host/...` → `scheme://***@host/...`. Anything that does not look
/// like a URL with an authority is hidden entirely rather than guessed at.
///
/// The user info ends at the *last* `@` of the URL. RFC 3986 lets the user info hold `/`,
/// `?`, `#` and `@` only percent-escaped, but passwords are often pasted raw: taking the
/// host part to end at the first `/`, `?` or `#` would print the tail of such a password.
/// An `@` in the path or query (rare in broker and database URLs) then hides everything up
/// to it too: the redaction may hide more than the credentials, never less.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<redacted url>".to_owned();
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    {
        return "<redacted url>".to_owned();
    }
    match rest.rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => format!("{scheme}://{rest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "amqp://app:s3cret@rabbit.internal:5672/%2f";

    #[test]
    fn redacts_credentials_in_every_shape() {
        let cases = [
            (URL, "amqp://***@rabbit.internal:5672/%2f"),
            ("amqps://u:p@h", "amqps://***@h"),
            (
                "amqp://user@h:1/v?heartbeat=5",
                "amqp://***@h:1/v?heartbeat=5",
            ),
            // A raw '@' in the password: everything up to the last '@' is hidden.
            ("amqp://u:p@ss@h/v", "amqp://***@h/v"),
            ("amqp://u:p%40ss@h/v", "amqp://***@h/v"),
            ("amqp://h:5672/%2f", "amqp://h:5672/%2f"),
            ("not a url u:p@h", "<redacted url>"),
            ("://u:p@h", "<redacted url>"),
        ];
        for (url, shown) in cases {
            let r = RedactedUrl::new(url);
            assert_eq!(r.to_string(), shown, "{url}");
            assert!(!format!("{r:?}").contains("s3cret"));
        }
        assert_eq!(RedactedUrl::new(URL).expose(), URL);
    }
}
