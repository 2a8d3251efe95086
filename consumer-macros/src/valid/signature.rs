//! The function's shape: `async fn(ctx: &mut Context<'_, DB>, message: M) -> Result<(), E>`.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::{
    FnArg, GenericArgument, GenericParam, ItemFn, PathArguments, ReturnType, Type, WherePredicate,
};

use super::errors::Errors;

/// What `expand` needs from a function whose shape fits.
pub(super) struct Signature {
    /// `DB` in `&mut Context<'_, DB>`.
    pub(super) db: Type,
    /// The second argument's type.
    pub(super) message: Type,
    /// The declared return type.
    pub(super) output: Type,
}

/// Checks the function's shape; `None` when it does not fit, with the reasons in `errors`.
pub(super) fn check_signature(item: &ItemFn, errors: &mut Errors) -> Option<Signature> {
    let sig = &item.sig;
    let errors_before = errors.count();

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
        (Some(db), Some(message), Some(output)) if errors.count() == errors_before => {
            Some(Signature {
                db,
                message,
                output,
            })
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
    use proc_macro2::TokenStream;
    use quote::{quote, ToTokens};

    use crate::ast;
    use crate::valid::{validate, Handler};

    fn check(item: TokenStream) -> Result<Handler, Vec<String>> {
        let item = ast::parse_item(item).expect("a function");
        validate(ast::parse_options(TokenStream::new()), item)
            .map_err(|errors| errors.into_iter().map(|e| e.to_string()).collect())
    }

    fn errors_for_fn(item: TokenStream) -> Vec<String> {
        match check(item) {
            Ok(_) => panic!("expected errors"),
            Err(errors) => errors,
        }
    }

    #[test]
    fn database_and_message_types_are_extracted() {
        let handler = check(quote!(
            async fn f<'c>(
                ctx: &mut consumer_core::Context<'c, sqlx::Sqlite>,
                InvoiceJob { order_id }: InvoiceJob,
            ) -> std::result::Result<(), MyError> {
                Ok(())
            }
        ))
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
        let handler = check(quote!(
            async fn f<'a, 'c: 'a>(ctx: &'a mut Context<'c, P>, m: M) -> Result<(), E>
            where
                'c: 'a,
            {
                Ok(())
            }
        ));
        assert!(handler.is_ok());
    }
}
