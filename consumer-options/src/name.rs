//! The handler name rule.

use crate::OptionError;

/// Checks a handler name: one or more ASCII letters, digits, `_`, `.` and `-`.
///
/// The name is the handler's identity in the inbox and shows up in logs and metrics, so it
/// stays plain: no spaces, no separators such as `/` or `:`, nothing outside ASCII.
pub fn check_handler_name(name: &str) -> Result<(), OptionError> {
    if name.is_empty() {
        return Err(OptionError::EmptyName);
    }
    match name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        Some(found) => Err(OptionError::NameCharacter {
            name: name.to_owned(),
            found,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_accepted() {
        for ok in [
            "send_invoice",
            "billing.send-invoice",
            "v2",
            "A.b_c-9",
            "-",
            ".",
        ] {
            assert_eq!(check_handler_name(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn an_empty_name_is_refused() {
        assert_eq!(check_handler_name(""), Err(OptionError::EmptyName));
        assert_eq!(
            OptionError::EmptyName.to_string(),
            "the handler name must not be empty"
        );
    }

    #[test]
    fn the_first_character_outside_the_rule_is_named() {
        for (bad, found) in [
            ("send invoice", ' '),
            ("a/b", '/'),
            ("größe", 'ö'),
            ("x:y", ':'),
            ("tab\there", '\t'),
            ("a/b c", '/'),
        ] {
            assert_eq!(
                check_handler_name(bad),
                Err(OptionError::NameCharacter {
                    name: bad.to_owned(),
                    found
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            check_handler_name("send invoice")
                .expect_err("a space")
                .to_string(),
            "invalid handler name \"send invoice\": ' ' is not allowed; \
             use letters, digits, `_`, `.` and `-`"
        );
    }
}
