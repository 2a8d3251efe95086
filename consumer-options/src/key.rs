//! Key templates: `"invoice-{order_id}"`.

use crate::OptionError;

/// One piece of a parsed key template.
///
/// The grammar has exactly these two pieces, and a renderer must handle both: the enum is
/// not `#[non_exhaustive]`, so that a new kind of piece would break the build of every
/// renderer rather than be skipped by one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text copied into the key as it is; `{{` and `}}` in the template are single braces
    /// here.
    Literal(String),
    /// A field of the message: its path of field names, outermost first (`{customer.id}` is
    /// `["customer", "id"]`). Never empty, and no name in it is empty.
    Field(Vec<String>),
}

/// Parses a key template such as `"invoice-{order_id}"` into its segments.
///
/// `{field}` takes a field of the message and `{a.b}` a nested one; field names use ASCII
/// letters, digits and `_`. `{{` and `}}` are literal braces. At least one field must be
/// named: a template of text only would give every message the same key. Adjacent text is
/// joined into one [`Segment::Literal`], so segments alternate between text and fields.
///
/// ```
/// use consumer_options::{parse_key_template, Segment};
///
/// assert_eq!(
///     parse_key_template("{{v2}}-{customer.id}"),
///     Ok(vec![
///         Segment::Literal("{v2}-".to_owned()),
///         Segment::Field(vec!["customer".to_owned(), "id".to_owned()]),
///     ])
/// );
/// ```
pub fn parse_key_template(template: &str) -> Result<Vec<Segment>, OptionError> {
    let mut segments = Vec::new();
    let mut literal = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                literal.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                literal.push('}');
            }
            '{' => {
                let field = field_path(&mut chars, template)?;
                if !literal.is_empty() {
                    segments.push(Segment::Literal(std::mem::take(&mut literal)));
                }
                segments.push(Segment::Field(field));
            }
            '}' => {
                return Err(OptionError::UnmatchedBrace {
                    template: template.to_owned(),
                })
            }
            c => literal.push(c),
        }
    }
    if !literal.is_empty() {
        segments.push(Segment::Literal(literal));
    }
    if !segments.iter().any(|s| matches!(s, Segment::Field(_))) {
        return Err(OptionError::KeyWithoutField {
            template: template.to_owned(),
        });
    }
    Ok(segments)
}

/// The path inside a `{…}`, after its `{`, up to and including the closing `}`.
fn field_path(
    chars: &mut impl Iterator<Item = char>,
    template: &str,
) -> Result<Vec<String>, OptionError> {
    let mut field = String::new();
    loop {
        match chars.next() {
            Some('}') => break,
            Some(c) if c.is_ascii_alphanumeric() || c == '_' || c == '.' => field.push(c),
            Some(found) => {
                return Err(OptionError::FieldCharacter {
                    template: template.to_owned(),
                    found,
                })
            }
            None => {
                return Err(OptionError::UnclosedBrace {
                    template: template.to_owned(),
                })
            }
        }
    }
    let path: Vec<String> = field.split('.').map(str::to_owned).collect();
    if path.iter().any(String::is_empty) {
        return Err(OptionError::EmptyField {
            template: template.to_owned(),
        });
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal(text: &str) -> Segment {
        Segment::Literal(text.to_owned())
    }

    fn field(path: &[&str]) -> Segment {
        Segment::Field(path.iter().map(|&name| name.to_owned()).collect())
    }

    #[test]
    fn fields_and_text_become_segments() {
        let cases: &[(&str, Vec<Segment>)] = &[
            (
                "invoice-{order_id}",
                vec![literal("invoice-"), field(&["order_id"])],
            ),
            (
                "invoice-{order_id}-{customer.id}",
                vec![
                    literal("invoice-"),
                    field(&["order_id"]),
                    literal("-"),
                    field(&["customer", "id"]),
                ],
            ),
            ("{a.b.c}", vec![field(&["a", "b", "c"])]),
            ("{x}{y}", vec![field(&["x"]), field(&["y"])]),
            ("{A_1.b2}", vec![field(&["A_1", "b2"])]),
            ("{id}:", vec![field(&["id"]), literal(":")]),
        ];
        for (template, segments) in cases {
            assert_eq!(
                parse_key_template(template).as_ref(),
                Ok(segments),
                "{template}"
            );
        }
    }

    #[test]
    fn doubled_braces_are_literal_braces() {
        let cases: &[(&str, Vec<Segment>)] = &[
            (
                "{{literal}}-{id}",
                vec![literal("{literal}-"), field(&["id"])],
            ),
            ("{{x}}-{id}", vec![literal("{x}-"), field(&["id"])]),
            ("{id}-{{", vec![field(&["id"]), literal("-{")]),
            ("}}{id}", vec![literal("}"), field(&["id"])]),
            ("{{{id}}}", vec![literal("{"), field(&["id"]), literal("}")]),
        ];
        for (template, segments) in cases {
            assert_eq!(
                parse_key_template(template).as_ref(),
                Ok(segments),
                "{template}"
            );
        }
    }

    #[test]
    fn a_template_without_a_field_is_refused() {
        for bad in ["invoice", "", "{{order_id}}"] {
            assert_eq!(
                parse_key_template(bad),
                Err(OptionError::KeyWithoutField {
                    template: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_key_template("invoice")
                .expect_err("no field")
                .to_string(),
            "key template \"invoice\" names no field: every message would get the same key"
        );
    }

    #[test]
    fn unbalanced_braces_are_refused() {
        for bad in ["invoice-{order_id", "invoice-{", "a-{", "{id}-{x"] {
            assert_eq!(
                parse_key_template(bad),
                Err(OptionError::UnclosedBrace {
                    template: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
        for bad in ["invoice-order_id}", "{id}}", "a-}", "}"] {
            assert_eq!(
                parse_key_template(bad),
                Err(OptionError::UnmatchedBrace {
                    template: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_key_template("a-{").expect_err("unclosed").to_string(),
            "unclosed `{` in key template \"a-{\" (write `{{` for a literal brace)"
        );
        assert_eq!(
            parse_key_template("a-}")
                .expect_err("unmatched")
                .to_string(),
            "unmatched `}` in key template \"a-}\" (write `}}` for a literal brace)"
        );
    }

    #[test]
    fn empty_field_names_are_refused() {
        for bad in ["{}", "{a..b}", "{.a}", "{a.}", "{.}", "x-{}-{id}"] {
            assert_eq!(
                parse_key_template(bad),
                Err(OptionError::EmptyField {
                    template: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn field_names_use_letters_digits_and_underscores() {
        for (bad, found) in [
            ("{order id}", ' '),
            ("{a b}", ' '),
            ("{a-b}", '-'),
            ("{a{b}}", '{'),
            ("{größe}", 'ö'),
            ("{a:b}", ':'),
        ] {
            assert_eq!(
                parse_key_template(bad),
                Err(OptionError::FieldCharacter {
                    template: bad.to_owned(),
                    found
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_key_template("{a-b}").expect_err("a dash").to_string(),
            "unexpected '-' inside `{…}` in key template \"{a-b}\": \
             field names use letters, digits, `_` and `.`"
        );
    }
}
