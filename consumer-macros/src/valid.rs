//! Step 2, validation: checks the options and the function's signature and builds the model
//! that `expand` turns into code. Every problem is collected before any is reported, and each
//! error is spanned on the token that causes it.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{
    Expr, FnArg, GenericArgument, GenericParam, Ident, ItemFn, Lit, LitBool, LitInt, LitStr, Meta,
    PathArguments, ReturnType, Type, WherePredicate,
};

use crate::values::{self, ConflictPolicy};

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
];

/// A function that passed validation, with what `expand` needs from it.
pub(crate) struct Handler {
    /// The function as written; its signature and body become `call`.
    pub(crate) item: ItemFn,
    /// `DB` in `&mut Context<'_, DB>`.
    pub(crate) db: Type,
    /// The second argument's type.
    pub(crate) message: Type,
    /// The declared return type, so that a failed error conversion points at it.
    pub(crate) output: Type,
    /// The options, checked.
    pub(crate) options: Options,
    /// The batch function named by `batch = "..."`, spanned on that string.
    pub(crate) batch: Option<syn::Path>,
}

/// The attribute's options, checked. `None` means "not given": `HandlerOptions::new`'s
/// default applies, so the defaults live in one place, consumer-core.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Options {
    /// The handler's stable name; the function's name when not given.
    pub(crate) name: String,
    pub(crate) key: Option<String>,
    pub(crate) payload_hash: Option<bool>,
    pub(crate) max_attempts: Option<u32>,
    /// (base, cap) in milliseconds.
    pub(crate) backoff: Option<(u64, u64)>,
    /// Milliseconds.
    pub(crate) retention: Option<u64>,
    /// Milliseconds.
    pub(crate) timeout: Option<u64>,
    pub(crate) on_conflict: Option<ConflictPolicy>,
    /// The batch function's path, as written.
    pub(crate) batch: Option<String>,
}

/// Errors collected so far; reported together.
#[derive(Default)]
struct Errors {
    all: Option<syn::Error>,
    count: usize,
}

impl Errors {
    fn push(&mut self, error: syn::Error) {
        self.count += 1;
        match &mut self.all {
            Some(all) => all.combine(error),
            None => self.all = Some(error),
        }
    }

    fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    fn at(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }
}

/// Checks the parsed attribute and function; `Err` holds every problem found.
pub(crate) fn validate(
    options: syn::Result<Vec<Meta>>,
    item: ItemFn,
) -> Result<Handler, syn::Error> {
    let mut errors = Errors::default();
    let (options, batch) = match options {
        Ok(metas) => {
            let (options, batch) = check_options(metas, &item.sig.ident, &mut errors);
            (Some(options), batch)
        }
        Err(syntax) => {
            errors.push(syntax);
            (None, None)
        }
    };
    let signature = check_signature(&item, &mut errors);
    match (errors.all, options, signature) {
        (None, Some(options), Some((db, message, output))) => Ok(Handler {
            item,
            db,
            message,
            output,
            options,
            batch,
        }),
        (Some(errors), _, _) => Err(errors),
        // Every `None` above comes with an error pushed.
        (None, _, _) => Err(syn::Error::new(
            Span::call_site(),
            "`#[handler]`: internal error",
        )),
    }
}

/// The options, and the batch function's path (spanned on its string) if one is named.
fn check_options(
    metas: Vec<Meta>,
    fn_name: &Ident,
    errors: &mut Errors,
) -> (Options, Option<syn::Path>) {
    let mut options = Options::default();
    let mut batch = None;
    let mut name = None;
    let mut seen: Vec<String> = Vec::new();
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
                on(&lit, values::check_name(&lit.value()))?;
                name = Some(lit.value());
                Ok(())
            }),
            "key" => string(value, &key).and_then(|lit| {
                on(&lit, values::check_key_template(&lit.value()))?;
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
                options.backoff = Some(on(&lit, values::parse_backoff(&lit.value()))?);
                Ok(())
            }),
            "retention" => string(value, &key).and_then(|lit| {
                options.retention = Some(on(&lit, values::parse_duration(&lit.value()))?);
                Ok(())
            }),
            "timeout" => string(value, &key).and_then(|lit| {
                let ms = on(&lit, values::parse_duration(&lit.value()))?;
                if ms == 0 {
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
                options.on_conflict = Some(on(&lit, values::parse_conflict_policy(&lit.value()))?);
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
            _ => unreachable!("`{key}` is in OPTIONS but not handled"),
        };
        if let Err(error) = checked {
            errors.push(error);
        }
    }
    options.name = match name {
        Some(name) => name,
        None => {
            // The default is the function's name as written, never a module path: moving the
            // function to another module must not change its identity in the inbox.
            let name = fn_name.unraw().to_string();
            if let Err(reason) = values::check_name(&name) {
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
fn on<T>(lit: &LitStr, checked: Result<T, String>) -> syn::Result<T> {
    checked.map_err(|reason| syn::Error::new(lit.span(), reason))
}

/// Checks the function's shape; returns (DB, message type, return type) when it fits.
fn check_signature(item: &ItemFn, errors: &mut Errors) -> Option<(Type, Type, Type)> {
    let sig = &item.sig;
    let errors_before = errors.count;

    if sig.asyncness.is_none() {
        errors.at(sig.fn_token.span, "a handler must be an `async fn`");
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.at(unsafety.span, "a handler cannot be `unsafe`");
    }
    if let Some(abi) = &sig.abi {
        errors.spanned(abi, "a handler cannot declare an ABI");
    }

    // Lifetime parameters are fine (`Context<'c, DB>` may name its lifetime); type and const
    // parameters are not: a handler is one message type on one database.
    for param in &sig.generics.params {
        if !matches!(param, GenericParam::Lifetime(_)) {
            errors.spanned(
                param,
                "generic handlers are not supported: a handler takes one message type on one \
                 database; write a handler per type, each calling a shared generic function",
            );
        }
    }
    if let Some(where_clause) = &sig.generics.where_clause {
        for predicate in &where_clause.predicates {
            if !matches!(predicate, WherePredicate::Lifetime(_)) {
                errors.spanned(
                    predicate,
                    "generic handlers are not supported: `where` bounds may only relate lifetimes",
                );
            }
        }
    }

    let mut typed = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(receiver) => errors.spanned(
                receiver,
                "a handler is a free `async fn`, not a method: remove `self`",
            ),
            FnArg::Typed(pat_type) => typed.push(pat_type),
        }
    }
    let (db, message) = match typed.as_slice() {
        [ctx, message] if names_context(&message.ty) && !names_context(&ctx.ty) => {
            errors.spanned(
                &sig.inputs,
                "the context comes first: `(ctx: &mut Context<'_, DB>, message: M)`",
            );
            (None, None)
        }
        [ctx, message] => (
            context_db(&ctx.ty, errors),
            message_type(&message.ty, errors),
        ),
        [] | [_] => {
            let found = if typed.is_empty() { "none" } else { "one" };
            errors.at(
                sig.paren_token.span.join(),
                format!(
                    "a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; \
                     found {found}"
                ),
            );
            (None, None)
        }
        [_, _, extra @ ..] => {
            let extra: TokenStream = extra.iter().map(|arg| arg.to_token_stream()).collect();
            errors.spanned(
                extra,
                format!(
                    "a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; \
                     found {}",
                    typed.len()
                ),
            );
            (None, None)
        }
    };

    let output = match &sig.output {
        ReturnType::Default => {
            errors.at(
                sig.paren_token.span.close(),
                "a handler must return `Result<(), E>` where `E` converts into `HandlerError`",
            );
            None
        }
        ReturnType::Type(_, ty) => result_type(ty, errors),
    };

    match (db, message, output) {
        (Some(db), Some(message), Some(output)) if errors.count == errors_before => {
            Some((db, message, output))
        }
        _ => None,
    }
}

fn ungroup_type(mut ty: &Type) -> &Type {
    loop {
        match ty {
            Type::Group(group) => ty = &group.elem,
            Type::Paren(paren) => ty = &paren.elem,
            _ => return ty,
        }
    }
}

/// Whether `ty` is a reference to something called `Context`: tells swapped arguments apart
/// from a wrong first argument.
fn names_context(ty: &Type) -> bool {
    match ungroup_type(ty) {
        Type::Reference(reference) => matches!(
            ungroup_type(&reference.elem),
            Type::Path(path) if path.path.segments.last().is_some_and(|s| s.ident == "Context")
        ),
        _ => false,
    }
}

/// `DB` from `&mut Context<'_, DB>`: any path whose last segment is `Context`, with the
/// database as its last generic argument.
fn context_db(ty: &Type, errors: &mut Errors) -> Option<Type> {
    const EXPECTED: &str = "the first argument must be `ctx: &mut Context<'_, DB>`";
    let Type::Reference(reference) = ungroup_type(ty) else {
        errors.spanned(ty, EXPECTED);
        return None;
    };
    if reference.mutability.is_none() {
        errors.spanned(ty, format!("{EXPECTED}: the context is borrowed mutably"));
        return None;
    }
    let context = match ungroup_type(&reference.elem) {
        Type::Path(path) if path.qself.is_none() => path.path.segments.last(),
        _ => None,
    };
    let Some(context) = context.filter(|segment| segment.ident == "Context") else {
        errors.spanned(&reference.elem, EXPECTED);
        return None;
    };
    let db = match &context.arguments {
        PathArguments::AngleBracketed(args) => match args.args.last() {
            Some(GenericArgument::Type(db)) => Some(db.clone()),
            _ => None,
        },
        _ => None,
    };
    if db.is_none() {
        errors.spanned(
            context,
            format!("{EXPECTED}: name the database as its last generic argument, e.g. `Context<'_, sqlx::Postgres>`"),
        );
    }
    db
}

/// The message type: owned, and concrete.
fn message_type(ty: &Type, errors: &mut Errors) -> Option<Type> {
    match ungroup_type(ty) {
        Type::Reference(_) => errors.spanned(
            ty,
            "the message must be an owned type: it is decoded from the payload for each delivery",
        ),
        Type::ImplTrait(_) | Type::Infer(_) => errors.spanned(
            ty,
            "the message must be a concrete type that implements `serde::de::DeserializeOwned`",
        ),
        _ => return Some(ty.clone()),
    }
    None
}

/// The return type must be `Result<(), E>`: a path ending in `Result` whose first generic
/// argument, if any, is `()` (so `io::Result<()>`-style aliases pass). Whether `E` converts
/// into `HandlerError` is left to the trait bound, which points at this type.
fn result_type(ty: &Type, errors: &mut Errors) -> Option<Type> {
    const EXPECTED: &str =
        "a handler must return `Result<(), E>` where `E` converts into `HandlerError`";
    let segment = match ungroup_type(ty) {
        Type::Path(path) if path.qself.is_none() => path.path.segments.last(),
        _ => None,
    };
    let Some(segment) = segment.filter(|segment| segment.ident == "Result") else {
        errors.spanned(ty, EXPECTED);
        return None;
    };
    if let PathArguments::AngleBracketed(args) = &segment.arguments {
        if let Some(GenericArgument::Type(ok)) = args.args.first() {
            let is_unit = matches!(ungroup_type(ok), Type::Tuple(tuple) if tuple.elems.is_empty());
            if !is_unit {
                errors.spanned(
                    ok,
                    format!("{EXPECTED}: a handler's result carries no value"),
                );
                return None;
            }
        }
    }
    Some(ty.clone())
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;
    use crate::ast;

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

    fn errors_for_fn(item: TokenStream) -> Vec<String> {
        match check(TokenStream::new(), item) {
            Ok(_) => panic!("expected errors"),
            Err(errors) => errors,
        }
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
        ));
        assert_eq!(
            got,
            Ok(Options {
                name: "billing.send-invoice".to_owned(),
                key: Some("invoice-{order_id}".to_owned()),
                payload_hash: Some(true),
                max_attempts: Some(7),
                backoff: Some((200, 30_000)),
                retention: Some(7 * 86_400_000),
                timeout: Some(30_000),
                on_conflict: Some(ConflictPolicy::Skip),
                batch: Some("crate::billing::send_invoices".to_owned()),
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
            "unknown option `colour`; valid options are `name`, `key`, `max_attempts`, `backoff`, `retention`, `timeout`, `payload_hash`, `on_conflict`, `batch`",
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
                "expected an option name, one of `name`, `key`, `max_attempts`, `backoff`, `retention`, `timeout`, `payload_hash`, `on_conflict`, `batch`",
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
        let errors = errors_for_fn(quote!(
            async fn größe(ctx: &mut Context<'_, Sqlite>, m: M) -> Result<(), E> {
                Ok(())
            }
        ));
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("give the handler a name with `name = \"...\"`"));
    }

    #[test]
    fn database_and_message_types_are_extracted() {
        let handler = check(
            quote!(),
            quote!(
                async fn f<'c>(
                    ctx: &mut consumer_core::Context<'c, sqlx::Sqlite>,
                    InvoiceJob { order_id }: InvoiceJob,
                ) -> std::result::Result<(), MyError> {
                    Ok(())
                }
            ),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(handler.db.to_token_stream().to_string(), "sqlx :: Sqlite");
        assert_eq!(handler.message.to_token_stream().to_string(), "InvoiceJob");
        assert_eq!(
            handler.output.to_token_stream().to_string(),
            "std :: result :: Result < () , MyError >"
        );
    }

    #[test]
    fn signature_errors() {
        let cases: &[(TokenStream, &[&str])] = &[
            (
                quote!(fn f(ctx: &mut Context<'_, P>, m: M) -> Result<(), E> { Ok(()) }),
                &["a handler must be an `async fn`"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>) -> Result<(), E> { Ok(()) }),
                &["a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; found one"],
            ),
            (
                quote!(async fn f() -> Result<(), E> { Ok(()) }),
                &["a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; found none"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: M, x: u8) -> Result<(), E> { Ok(()) }),
                &["a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; found 3"],
            ),
            (
                quote!(async fn f(&self, ctx: &mut Context<'_, P>, m: M) -> Result<(), E> { Ok(()) }),
                &["a handler is a free `async fn`, not a method: remove `self`"],
            ),
            (
                quote!(async fn f(ctx: &Context<'_, P>, m: M) -> Result<(), E> { Ok(()) }),
                &["the first argument must be `ctx: &mut Context<'_, DB>`: the context is borrowed mutably"],
            ),
            (
                quote!(async fn f(ctx: Context<'_, P>, m: M) -> Result<(), E> { Ok(()) }),
                &["the first argument must be `ctx: &mut Context<'_, DB>`"],
            ),
            (
                quote!(async fn f(ctx: &mut Ctx<'_, P>, m: M) -> Result<(), E> { Ok(()) }),
                &["the first argument must be `ctx: &mut Context<'_, DB>`"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_>, m: M) -> Result<(), E> { Ok(()) }),
                &["the first argument must be `ctx: &mut Context<'_, DB>`: name the database as its last generic argument, e.g. `Context<'_, sqlx::Postgres>`"],
            ),
            (
                quote!(async fn f(m: M, ctx: &mut Context<'_, P>) -> Result<(), E> { Ok(()) }),
                &["the context comes first: `(ctx: &mut Context<'_, DB>, message: M)`"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: &M) -> Result<(), E> { Ok(()) }),
                &["the message must be an owned type: it is decoded from the payload for each delivery"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: impl Msg) -> Result<(), E> { Ok(()) }),
                &["the message must be a concrete type that implements `serde::de::DeserializeOwned`"],
            ),
            (
                quote!(async fn f<M: Msg, const N: usize>(ctx: &mut Context<'_, P>, m: M) -> Result<(), E> where M: Send { Ok(()) }),
                &[
                    "generic handlers are not supported: a handler takes one message type on one database; write a handler per type, each calling a shared generic function",
                    "generic handlers are not supported: a handler takes one message type on one database; write a handler per type, each calling a shared generic function",
                    "generic handlers are not supported: `where` bounds may only relate lifetimes",
                ],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: M) { }),
                &["a handler must return `Result<(), E>` where `E` converts into `HandlerError`"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: M) -> Option<()> { None }),
                &["a handler must return `Result<(), E>` where `E` converts into `HandlerError`"],
            ),
            (
                quote!(async fn f(ctx: &mut Context<'_, P>, m: M) -> Result<u32, E> { Ok(1) }),
                &["a handler must return `Result<(), E>` where `E` converts into `HandlerError`: a handler's result carries no value"],
            ),
            (
                quote!(unsafe fn f(x: u8) {}),
                &[
                    "a handler must be an `async fn`",
                    "a handler cannot be `unsafe`",
                    "a handler takes 2 arguments, `ctx: &mut Context<'_, DB>` and the message; found one",
                    "a handler must return `Result<(), E>` where `E` converts into `HandlerError`",
                ],
            ),
        ];
        for (item, expected) in cases {
            assert_eq!(&errors_for_fn(item.clone()), expected, "{item}");
        }
    }

    #[test]
    fn lifetime_generics_are_accepted() {
        let handler = check(
            quote!(),
            quote!(
                async fn f<'a, 'c: 'a>(ctx: &'a mut Context<'c, P>, m: M) -> Result<(), E>
                where
                    'c: 'a,
                {
                    Ok(())
                }
            ),
        );
        assert!(handler.is_ok());
    }

    #[test]
    fn option_and_signature_errors_are_reported_together() {
        let errors = check(
            quote!(max_attempts = 0),
            quote!(
                fn f(ctx: &mut Context<'_, P>, m: M) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .err()
        .expect("invalid");
        assert_eq!(
            errors,
            [
                "`max_attempts` must be at least 1: it counts the first attempt",
                "a handler must be an `async fn`",
            ]
        );
    }

    #[test]
    fn an_attribute_syntax_error_is_reported_with_signature_errors() {
        let errors = check(
            quote!(name = ),
            quote!(
                fn f(ctx: &mut Context<'_, P>, m: M) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .err()
        .expect("invalid");
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!(errors[1], "a handler must be an `async fn`");
    }
}
