//! Names of database objects from configuration (schemas, tables): validated, then quoted.
//! The inbox, the HTTP layer's store and an application's own configuration check the names
//! they are given with [`Identifier::parse`].

use crate::Error;

/// The longest identifier accepted. PostgreSQL truncates at 63 bytes; the inbox derives
/// index names by appending a suffix, so table names keep room for it.
pub const MAX_IDENTIFIER_LEN: usize = 48;

/// A name checked against `[A-Za-z_][A-Za-z0-9_]*` (at most [`MAX_IDENTIFIER_LEN`] bytes).
///
/// Because of the check, [`Identifier::quoted`] can never produce SQL injection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identifier(String);

impl Identifier {
    /// Validates `value`; the error names `field`.
    pub fn parse(field: &'static str, value: &str) -> Result<Self, Error> {
        let mut chars = value.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(Error::config(
                field,
                format!(
                    "{value:?} is not an identifier: use letters, digits and `_`, starting with a letter or `_`"
                ),
            ));
        }
        if value.len() > MAX_IDENTIFIER_LEN {
            return Err(Error::config(
                field,
                format!("{value:?} is longer than {MAX_IDENTIFIER_LEN} characters"),
            ));
        }
        Ok(Identifier(value.to_owned()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name in double quotes, ready for SQL.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl std::fmt::Display for Identifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names_and_quotes_them() {
        let id = Identifier::parse("inbox.table", "consumer_inbox").unwrap();
        assert_eq!(id.quoted(), "\"consumer_inbox\"");
        assert!(Identifier::parse("t", "_x9").is_ok());
    }

    #[test]
    fn rejects_injection_and_names_the_field() {
        for bad in [
            "",
            "1abc",
            "a-b",
            "a\"b",
            "x; DROP TABLE y",
            "é",
            &"a".repeat(49),
        ] {
            let err = Identifier::parse("inbox.table", bad).unwrap_err();
            assert!(err.to_string().contains("inbox.table"), "{err}");
        }
    }
}
