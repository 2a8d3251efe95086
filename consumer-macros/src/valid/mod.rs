//! Step 2, validation: checks the options and the function's signature and builds the model
//! that `expand` turns into code. Every problem is collected before any is reported, and each
//! error is spanned on the token that causes it.

mod errors;
mod options;
mod signature;

use proc_macro2::Span;
use syn::{ItemFn, Meta, Type};

use errors::Errors;
use options::check_options;
pub(crate) use options::{ConflictPolicy, Options};
use signature::{check_signature, Signature};

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
    match (errors.finish(), options, signature) {
        (
            None,
            Some(options),
            Some(Signature {
                db,
                message,
                output,
            }),
        ) => Ok(Handler {
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

#[cfg(test)]
mod tests {
    use proc_macro2::TokenStream;
    use quote::quote;

    use super::*;
    use crate::ast;

    fn check(args: TokenStream, item: TokenStream) -> Result<Handler, Vec<String>> {
        let item = ast::parse_item(item).expect("a function");
        validate(ast::parse_options(args), item)
            .map_err(|errors| errors.into_iter().map(|e| e.to_string()).collect())
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
