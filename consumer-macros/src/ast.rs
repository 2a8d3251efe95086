//! Step 1, parsing: syntax only. What the options mean and whether the function fits is
//! `valid`'s business, so that every problem can be reported at once.

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{ItemFn, Meta, Token};

/// The attribute's arguments as written: `name = value` pairs, separated by commas.
///
/// Parsed as [`Meta`] rather than as name-value pairs so that `#[handler(payload_hash)]` or
/// `#[handler(name("x"))]` reach validation and get an error that shows the expected form,
/// instead of a bare syntax error.
pub(crate) fn parse_options(args: TokenStream) -> syn::Result<Vec<Meta>> {
    let list = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(args)?;
    Ok(list.into_iter().collect())
}

/// The item under the attribute, which must be a function.
///
/// rustc has already parsed the item, so a failure here means it is some other kind of item;
/// the error points at the attribute.
pub(crate) fn parse_item(item: TokenStream) -> syn::Result<ItemFn> {
    syn::parse2(item).map_err(|_| {
        syn::Error::new(
            Span::call_site(),
            "`#[handler]` goes on an `async fn(ctx: &mut Context<'_, DB>, message: M)`",
        )
    })
}
