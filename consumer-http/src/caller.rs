//! Whose a stored answer is: the caller a user function names, or every caller (an
//! explicit opt-out). The layer's builder has no `build` until one of the two is chosen.

use std::sync::Arc;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// Names a request's caller from its parts.
type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// How the [`IdempotencyLayer`](crate::IdempotencyLayer) tells callers apart, chosen on its
/// builder with [`caller`](crate::IdempotencyLayerBuilder::caller) or
/// [`shared_across_callers`](crate::IdempotencyLayerBuilder::shared_across_callers).
#[derive(Clone)]
pub struct Callers(Scoping);

#[derive(Clone)]
enum Scoping {
    /// Every caller has records of its own, named by the function.
    Each(Arc<CallerFn>),
    /// One record per key, whoever sends it.
    Shared,
}

/// The state of an [`IdempotencyLayerBuilder`](crate::IdempotencyLayerBuilder) whose
/// caller is not named yet: it cannot build a layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallerUnnamed;

/// A builder state that says whose the stored answers are: only [`Callers`], which
/// [`caller`](crate::IdempotencyLayerBuilder::caller) and
/// [`shared_across_callers`](crate::IdempotencyLayerBuilder::shared_across_callers) set.
#[diagnostic::on_unimplemented(
    message = "the idempotency layer does not know whose stored answers are whose",
    label = "the caller is not named",
    note = "name the authenticated caller with `.caller(|parts| ...)` before `.build()`, or call `.shared_across_callers()` if every caller may be answered what any caller stored under a key"
)]
pub trait CallerNamed: Into<Callers> {}

impl CallerNamed for Callers {}

/// The request names no caller: the caller function returned `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoCaller;

impl Callers {
    /// Records per caller, named by `caller`.
    pub(crate) fn each(caller: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Callers(Scoping::Each(Arc::new(caller)))
    }

    /// One record per key for every caller.
    pub(crate) fn shared() -> Self {
        Callers(Scoping::Shared)
    }

    /// Whether every caller shares the records (no caller function).
    pub(crate) fn is_shared(&self) -> bool {
        matches!(self.0, Scoping::Shared)
    }

    /// The caller's part of the request's scope: the SHA-256 (hex) of the name the function
    /// gave, so neither the store nor Redis ever holds what it returned (a credential
    /// returned by mistake included); `None` when shared.
    pub(crate) fn of(&self, parts: &Parts) -> Result<Option<String>, NoCaller> {
        match &self.0 {
            Scoping::Shared => Ok(None),
            Scoping::Each(caller) => {
                let name = caller(parts).ok_or(NoCaller)?;
                Ok(Some(hex::encode(Sha256::digest(name.as_bytes()))))
            }
        }
    }
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Scoping::Each(_) => "Callers(each its own)",
            Scoping::Shared => "Callers(shared across callers)",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(authorization: Option<&str>) -> Parts {
        let mut b = http::Request::builder().method("POST").uri("/p");
        if let Some(a) = authorization {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap_or_default().into_parts().0
    }

    fn by_header(parts: &Parts) -> Option<String> {
        let value = parts.headers.get("authorization")?.to_str().ok()?;
        value.strip_prefix("Bearer ").map(str::to_owned)
    }

    #[test]
    fn each_caller_is_a_hash_of_its_name_and_a_missing_one_is_refused() {
        let each = Callers::each(by_header);
        let a = each.of(&parts(Some("Bearer a"))).ok().flatten();
        let b = each.of(&parts(Some("Bearer b"))).ok().flatten();
        assert!(a.is_some() && b.is_some());
        assert_ne!(a, b);
        // The name itself is never kept, only its hash.
        assert_eq!(a, Some(hex::encode(Sha256::digest(b"a"))));
        assert_eq!(each.of(&parts(None)), Err(NoCaller));
        assert_eq!(Callers::shared().of(&parts(Some("Bearer a"))), Ok(None));
        assert_eq!(Callers::shared().of(&parts(None)), Ok(None));
    }
}
