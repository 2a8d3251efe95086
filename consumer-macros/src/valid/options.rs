//! The attribute's options: which exist, the form of each, and their values' grammar. The
//! grammar of names, key templates, durations and backoff ranges is `consumer_options`', the
//! one the runtime checks too; a value it refuses gets its message on the literal's span.

use std::time::Duration;

use consumer_options::BackoffRange;
use syn::ext::IdentExt;
use syn::{Expr, Ident, Lit, LitBool, LitInt, LitStr, Meta};

use super::errors::Errors;

/// Every option, in the order they are listed in the "unknown option" error.
const OPTIONS: &[&str] = &[
    "name",
    "key",
    "max_attempts",
    "backoff",
    "retention",
    "timeout",
    "payload_hash",
    "on_conflict",
    "batch",
    "aliases",
];

/// The attribute's options, checked. `None` means "not given": `HandlerOptions::new`'s
/// default applies, so the defaults live in one place, consumer-core.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Options {
    /// The handler's stable name; the function's name when not given.
    pub(crate) name: String,
    pub(crate) key: Option<String>,
    pub(crate) payload_hash: Option<bool>,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) backoff: Option<BackoffRange>,
    pub(crate) retention: Option<Duration>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) on_conflict: Option<ConflictPolicy>,
    /// The batch function's path, as written.
    pub(crate) batch: Option<String>,
    /// The handler's former names, whose inbox keys it takes over.
    pub(crate) aliases: Vec<String>,
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
fn parse_conflict_policy(text: &str) -> Result<ConflictPolicy, String> {
    match text {
        "dead_letter" => Ok(ConflictPolicy::DeadLetter),
        "skip" => Ok(ConflictPolicy::Skip),
        _ => Err(format!(
            "unknown conflict policy {text:?}: expected \"dead_letter\" or \"skip\""
        )),
    }
}

/// The options, and the batch function's path (spanned on its string) if one is named.
pub(super) fn check_options(
    metas: Vec<Meta>,
    fn_name: &Ident,
    errors: &mut Errors,
) -> (Options, Option<syn::Path>) {
    let mut options = Options::default();
    let mut batch = None;
    let mut name = None;
    let mut seen: Vec<String> = Vec::new();
    let mut alias_lits: Vec<LitStr> = Vec::new();
    for meta in metas {
        let Some(option) = meta.path().get_ident() else {
            errors.spanned(
                meta.path(),
                format!("expected an option name, one of {}", list_options()),
            );
            continue;
        };
        let option = option.unraw();
        let key = option.to_string();
        if !OPTIONS.contains(&key.as_str()) {
            errors.spanned(
                &option,
                format!(
                    "unknown option `{key}`; valid options are {}",
                    list_options()
                ),
            );
            continue;
        }
        if seen.contains(&key) {
            errors.spanned(&option, format!("duplicate option `{key}`"));
            continue;
        }
        seen.push(key.clone());
        let Meta::NameValue(pair) = meta else {
            errors.spanned(&meta, format!("expected `{key} = {}`", example(&key)));
            continue;
        };
        let value = ungroup(&pair.value);
        let checked = match key.as_str() {
            "name" => string(value, &key).and_then(|lit| {
                on(&lit, consumer_options::check_handler_name(&lit.value()))?;
                name = Some(lit.value());
                Ok(())
            }),
            "key" => string(value, &key).and_then(|lit| {
                on(&lit, consumer_options::parse_key_template(&lit.value()))?;
                options.key = Some(lit.value());
                Ok(())
            }),
            "max_attempts" => integer(value, &key).and_then(|lit| {
                let n: u32 = lit.base10_parse().map_err(|_| {
                    syn::Error::new_spanned(&lit, "`max_attempts` must fit in a `u32`")
                })?;
                if n == 0 {
                    return Err(syn::Error::new_spanned(
                        &lit,
                        "`max_attempts` must be at least 1: it counts the first attempt",
                    ));
                }
                options.max_attempts = Some(n);
                Ok(())
            }),
            "backoff" => string(value, &key).and_then(|lit| {
                options.backoff = Some(on(&lit, BackoffRange::parse(&lit.value()))?);
                Ok(())
            }),
            "retention" => string(value, &key).and_then(|lit| {
                options.retention = Some(on(&lit, consumer_options::parse_duration(&lit.value()))?);
                Ok(())
            }),
            "timeout" => string(value, &key).and_then(|lit| {
                let ms = on(&lit, consumer_options::parse_duration(&lit.value()))?;
                if ms.is_zero() {
                    return Err(syn::Error::new_spanned(
                        &lit,
                        "`timeout` must be greater than zero",
                    ));
                }
                options.timeout = Some(ms);
                Ok(())
            }),
            "payload_hash" => boolean(value, &key).map(|lit| {
                options.payload_hash = Some(lit.value);
            }),
            "on_conflict" => string(value, &key).and_then(|lit| {
                options.on_conflict = Some(on(&lit, parse_conflict_policy(&lit.value()))?);
                Ok(())
            }),
            "batch" => string(value, &key).and_then(|lit| {
                let path = lit.parse::<syn::Path>().map_err(|_| {
                    syn::Error::new_spanned(
                        &lit,
                        "`batch` names the batch function by its path, as in `batch = \"insert_invoices\"`",
                    )
                })?;
                batch = Some(path);
                options.batch = Some(lit.value());
                Ok(())
            }),
            "aliases" => aliases(value, errors).map(|lits| alias_lits = lits),
            _ => unreachable!("`{key}` is in OPTIONS but not handled"),
        };
        if let Err(error) = checked {
            errors.push(error);
        }
    }
    let own = name.clone().unwrap_or_else(|| fn_name.unraw().to_string());
    for lit in alias_lits {
        if lit.value() == own {
            errors.spanned(
                &lit,
                format!(
                    "`aliases` lists the handler's own name {own:?}: an alias is a former name"
                ),
            );
        } else {
            options.aliases.push(lit.value());
        }
    }
    options.name = match name {
        Some(name) => name,
        None => {
            // The default is the function's name as written, never a module path: moving the
            // function to another module must not change its identity in the inbox.
            let name = fn_name.unraw().to_string();
            if let Err(reason) = consumer_options::check_handler_name(&name) {
                errors.spanned(
                    fn_name,
                    format!("{reason}; give the handler a name with `name = \"...\"`"),
                );
            }
            name
        }
    };
    (options, batch)
}

fn list_options() -> String {
    let quoted: Vec<String> = OPTIONS.iter().map(|o| format!("`{o}`")).collect();
    quoted.join(", ")
}

fn example(option: &str) -> &'static str {
    match option {
        "name" => "\"send_invoice\"",
        "key" => "\"invoice-{order_id}\"",
        "max_attempts" => "5",
        "backoff" => "\"200ms..30s\"",
        "retention" => "\"7d\"",
        "timeout" => "\"30s\"",
        "payload_hash" => "true",
        "on_conflict" => "\"dead_letter\"",
        "batch" => "\"insert_invoices\"",
        "aliases" => "[\"old_name\"]",
        _ => "...",
    }
}

/// Looks through the invisible groups `macro_rules!` wraps around `$value:expr`.
fn ungroup(mut expr: &Expr) -> &Expr {
    while let Expr::Group(group) = expr {
        expr = &group.expr;
    }
    expr
}

fn literal(value: &Expr) -> Option<&Lit> {
    match value {
        Expr::Lit(lit) => Some(&lit.lit),
        _ => None,
    }
}

fn wrong_type(value: &Expr, what: &str, option: &str) -> syn::Error {
    syn::Error::new_spanned(
        value,
        format!("expected {what}, as in `{option} = {}`", example(option)),
    )
}

/// `["old_name", ...]`: each a valid handler name, none twice. A bad element's error is
/// pushed on its literal and the others still checked; `Err` only when the value is no list.
fn aliases(value: &Expr, errors: &mut Errors) -> syn::Result<Vec<LitStr>> {
    let Expr::Array(list) = value else {
        return Err(wrong_type(value, "a list of names", "aliases"));
    };
    let mut names: Vec<LitStr> = Vec::new();
    for element in &list.elems {
        let checked = string(ungroup(element), "aliases").and_then(|lit| {
            on(&lit, consumer_options::check_handler_name(&lit.value()))?;
            if names.iter().any(|n| n.value() == lit.value()) {
                return Err(syn::Error::new_spanned(
                    &lit,
                    format!("alias {:?} is listed twice", lit.value()),
                ));
            }
            Ok(lit)
        });
        match checked {
            Ok(name) => names.push(name),
            Err(error) => errors.push(error),
        }
    }
    Ok(names)
}

fn string(value: &Expr, option: &str) -> syn::Result<LitStr> {
    match literal(value) {
        Some(Lit::Str(lit)) => Ok(lit.clone()),
        _ => Err(wrong_type(value, "a string", option)),
    }
}

fn integer(value: &Expr, option: &str) -> syn::Result<LitInt> {
    match literal(value) {
        Some(Lit::Int(lit)) => Ok(lit.clone()),
        _ => Err(wrong_type(value, "an integer", option)),
    }
}

fn boolean(value: &Expr, option: &str) -> syn::Result<LitBool> {
    match literal(value) {
        Some(Lit::Bool(lit)) => Ok(lit.clone()),
        _ => Err(wrong_type(value, "`true` or `false`", option)),
    }
}

/// Puts a value check's reason on the literal.
fn on<T>(lit: &LitStr, checked: Result<T, impl std::fmt::Display>) -> syn::Result<T> {
    checked.map_err(|reason| syn::Error::new(lit.span(), reason))
}

#[cfg(test)]
mod tests {
    use proc_macro2::TokenStream;
    use quote::quote;

    use super::*;
    use crate::ast;
    use crate::valid::{validate, Handler};

    fn check(args: TokenStream, item: TokenStream) -> Result<Handler, Vec<String>> {
        let item = ast::parse_item(item).expect("a function");
        validate(ast::parse_options(args), item)
            .map_err(|errors| errors.into_iter().map(|e| e.to_string()).collect())
    }

    fn options(args: TokenStream) -> Result<Options, Vec<String>> {
        check(
            args,
            quote!(
                async fn send_invoice(
                    ctx: &mut Context<'_, Postgres>,
                    job: InvoiceJob,
                ) -> Result<(), HandlerError> {
                    Ok(())
                }
            ),
        )
        .map(|handler| handler.options)
    }

    #[test]
    fn no_options_take_the_function_name_and_defaults() {
        assert_eq!(
            options(quote!()),
            Ok(Options {
                name: "send_invoice".to_owned(),
                ..Options::default()
            })
        );
    }

    #[test]
    fn every_option() {
        let got = options(quote!(
            name = "billing.send-invoice",
            key = "invoice-{order_id}",
            max_attempts = 7,
            backoff = "200ms..30s",
            retention = "7d",
            timeout = "30s",
            payload_hash = true,
            on_conflict = "skip",
            batch = "crate::billing::send_invoices",
            aliases = ["send_invoice_v1", "billing.invoice"],
        ));
        assert_eq!(
            got,
            Ok(Options {
                name: "billing.send-invoice".to_owned(),
                key: Some("invoice-{order_id}".to_owned()),
                payload_hash: Some(true),
                max_attempts: Some(7),
                backoff: BackoffRange::new(Duration::from_millis(200), Duration::from_secs(30))
                    .ok(),
                retention: Some(Duration::from_secs(7 * 86_400)),
                timeout: Some(Duration::from_secs(30)),
                on_conflict: Some(ConflictPolicy::Skip),
                batch: Some("crate::billing::send_invoices".to_owned()),
                aliases: vec!["send_invoice_v1".to_owned(), "billing.invoice".to_owned()],
            })
        );
    }

    #[test]
    fn every_option_error_is_reported_at_once() {
        let errors = options(quote!(
            name = "bad name",
            key = "no-field",
            max_attempts = 0,
            backoff = "30s..1s",
            retention = "forever",
            timeout = "0s",
            payload_hash = "yes",
            on_conflict = "ignore",
            batch = "not a path",
            colour = "blue",
            key = "dup-{id}",
            payload_hash,
        ))
        .expect_err("invalid");
        let expected = [
            "invalid handler name",
            "names no field",
            "must be at least 1",
            "shorter than its base",
            "invalid duration \"forever\"",
            "`timeout` must be greater than zero",
            "expected `true` or `false`, as in `payload_hash = true`",
            "unknown conflict policy",
            "`batch` names the batch function by its path, as in `batch = \"insert_invoices\"`",
            "unknown option `colour`; valid options are `name`, `key`, `max_attempts`, `backoff`, `retention`, `timeout`, `payload_hash`, `on_conflict`, `batch`, `aliases`",
            "duplicate option `key`",
            "duplicate option `payload_hash`",
        ];
        assert_eq!(errors.len(), expected.len(), "{errors:#?}");
        for (error, expected) in errors.iter().zip(expected) {
            assert!(
                error.contains(expected),
                "{error:?} should contain {expected:?}"
            );
        }
    }

    #[test]
    fn option_forms_other_than_name_value() {
        let errors = options(quote!(payload_hash, name("x"), a::b = 1)).expect_err("invalid");
        assert_eq!(
            errors,
            [
                "expected `payload_hash = true`",
                "expected `name = \"send_invoice\"`",
                "expected an option name, one of `name`, `key`, `max_attempts`, `backoff`, `retention`, `timeout`, `payload_hash`, `on_conflict`, `batch`, `aliases`",
            ]
        );
    }

    #[test]
    fn wrong_literal_types() {
        let errors = options(quote!(
            name = send_invoice,
            max_attempts = "5",
            timeout = 30,
            backoff = "1s".."2s",
        ))
        .expect_err("invalid");
        assert_eq!(
            errors,
            [
                "expected a string, as in `name = \"send_invoice\"`",
                "expected an integer, as in `max_attempts = 5`",
                "expected a string, as in `timeout = \"30s\"`",
                "expected a string, as in `backoff = \"200ms..30s\"`",
            ]
        );
    }

    #[test]
    fn max_attempts_must_fit_a_u32() {
        let errors = options(quote!(max_attempts = 4294967296)).expect_err("too large");
        assert_eq!(errors, ["`max_attempts` must fit in a `u32`"]);
        assert_eq!(
            options(quote!(max_attempts = 4294967295)).map(|o| o.max_attempts),
            Ok(Some(u32::MAX))
        );
    }

    #[test]
    fn a_raw_function_name_is_used_without_its_prefix() {
        let handler = check(
            quote!(),
            quote!(
                async fn r#match(ctx: &mut Context<'_, Sqlite>, m: M) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(handler.options.name, "match");
    }

    #[test]
    fn a_function_name_that_is_not_a_valid_handler_name_asks_for_one() {
        let errors = check(
            quote!(),
            quote!(
                async fn größe(ctx: &mut Context<'_, Sqlite>, m: M) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .err()
        .expect("invalid");
        assert_eq!(
            errors,
            ["invalid handler name \"größe\": 'ö' is not allowed; use letters, digits, `_`, `.` \
              and `-`; give the handler a name with `name = \"...\"`"]
        );
    }

    #[test]
    fn every_alias_error_is_reported_at_once() {
        let errors = options(quote!(
            aliases = ["bad name", "v1", "v1", 3, "send_invoice"]
        ))
        .expect_err("invalid");
        let expected = [
            "invalid handler name \"bad name\"",
            "alias \"v1\" is listed twice",
            "expected a string, as in `aliases = [\"old_name\"]`",
            "`aliases` lists the handler's own name \"send_invoice\"",
        ];
        assert_eq!(errors.len(), expected.len(), "{errors:#?}");
        for (error, expected) in errors.iter().zip(expected) {
            assert!(
                error.contains(expected),
                "{error:?} should contain {expected:?}"
            );
        }
        let errors = options(quote!(aliases = "v1")).expect_err("not a list");
        assert_eq!(
            errors,
            ["expected a list of names, as in `aliases = [\"old_name\"]`"]
        );
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
