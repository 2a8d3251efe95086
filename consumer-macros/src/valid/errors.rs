//! The errors found so far, reported together at the end.

use proc_macro2::Span;
use quote::ToTokens;

/// Errors collected so far; reported together.
#[derive(Default)]
pub(super) struct Errors {
    all: Option<syn::Error>,
    count: usize,
}

impl Errors {
    pub(super) fn push(&mut self, error: syn::Error) {
        self.count += 1;
        match &mut self.all {
            Some(all) => all.combine(error),
            None => self.all = Some(error),
        }
    }

    pub(super) fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub(super) fn at(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }

    /// How many errors have been pushed: a check compares it before and after to learn
    /// whether it found any.
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Every error, combined into one; `None` if there were none.
    pub(super) fn finish(self) -> Option<syn::Error> {
        self.all
    }
}
