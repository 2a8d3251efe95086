//! [`KeyFormat`]: the format a service declares for its keys, which the layer checks
//! (`request`) and its policy document describes (`policy`).

/// What an `Idempotency-Key` must look like besides printable ASCII of at most
/// [`MAX_IDEMPOTENCY_KEY_BYTES`](crate::MAX_IDEMPOTENCY_KEY_BYTES) bytes: the key format a service declares in its idempotency
/// policy (see [`IdempotencyConfigBuilder::key_format`](crate::IdempotencyConfigBuilder::key_format)). A key of another format is 400.
#[derive(Clone, Copy)]
pub struct KeyFormat {
    description: &'static str,
    check: fn(&str) -> bool,
}

impl KeyFormat {
    /// Any key (the default).
    pub fn any() -> Self {
        KeyFormat {
            description: "any",
            check: |_| true,
        }
    }

    /// A UUID in its hyphenated form, e.g. `8e03978e-40d5-43e8-bc93-6894a57f9324`, as the
    /// IETF draft recommends (any version; letters in either case).
    pub fn uuid() -> Self {
        KeyFormat {
            description: "a UUID (8-4-4-4-12 hexadecimal digits)",
            check: is_uuid,
        }
    }

    /// A format of the service's own: `description` names it in the 400's detail and in the
    /// policy document (e.g. `"ord_ followed by 24 letters or digits"`), `check` accepts a key.
    pub fn custom(description: &'static str, check: fn(&str) -> bool) -> Self {
        KeyFormat { description, check }
    }

    /// What the format asks for, in words.
    pub fn description(&self) -> &'static str {
        self.description
    }

    /// Whether `key` has this format.
    pub fn accepts(&self, key: &str) -> bool {
        (self.check)(key)
    }
}

impl std::fmt::Debug for KeyFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KeyFormat").field(&self.description).finish()
    }
}

/// Whether `key` is a hyphenated UUID.
fn is_uuid(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_formats_accept_what_they_describe() {
        let uuid = KeyFormat::uuid();
        assert!(uuid.accepts("8e03978e-40d5-43e8-bc93-6894a57f9324"));
        assert!(uuid.accepts("8E03978E-40D5-43E8-BC93-6894A57F9324"));
        for bad in [
            "8e03978e40d543e8bc936894a57f9324",
            "8e03978e-40d5-43e8-bc93-6894a57f932",
            "8e03978e-40d5-43e8-bc93-6894a57f932g",
            "8e03978e-40d5+43e8-bc93-6894a57f9324",
        ] {
            assert!(!uuid.accepts(bad), "{bad}");
        }
        assert!(KeyFormat::any().accepts("anything"));
        let custom = KeyFormat::custom("ord_ and digits", |k| k.starts_with("ord_"));
        assert!(custom.accepts("ord_1") && !custom.accepts("1"));
        assert_eq!(custom.description(), "ord_ and digits");
    }
}
