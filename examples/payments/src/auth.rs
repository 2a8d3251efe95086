//! Who is calling: API keys (`Authorization: Bearer <key>`) mapped to accounts, checked
//! before the `Idempotency-Key` layer, which keeps each account's answers apart.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The account a request was authenticated as; the idempotency layer's caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Account(pub(crate) String);

/// The API keys the service accepts, each with its account. Its `Debug` shows the accounts
/// only.
#[derive(Clone)]
pub(crate) struct ApiKeys(Arc<HashMap<String, Account>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut accounts: Vec<&str> = self.0.values().map(|a| a.0.as_str()).collect();
        accounts.sort_unstable();
        f.debug_struct("ApiKeys")
            .field("accounts", &accounts)
            .finish_non_exhaustive()
    }
}

impl ApiKeys {
    /// Reads `key=account` entries separated by commas. An error says which entry is wrong
    /// and why, never what it holds: the keys are credentials.
    pub(crate) fn parse(setting: &str) -> Result<ApiKeys, String> {
        let mut keys = HashMap::new();
        for (i, entry) in setting.split(',').enumerate() {
            let n = i + 1;
            let (key, account) = entry
                .trim()
                .split_once('=')
                .ok_or_else(|| format!("entry {n} is not `key=account`"))?;
            let (key, account) = (key.trim(), account.trim());
            if key.is_empty() || account.is_empty() {
                return Err(format!("entry {n} has an empty key or account"));
            }
            if keys
                .insert(key.to_owned(), Account(account.to_owned()))
                .is_some()
            {
                return Err(format!("entry {n} repeats an earlier entry's key"));
            }
        }
        Ok(ApiKeys(Arc::new(keys)))
    }

    /// The account of `Authorization: Bearer <key>`, if the key is known.
    fn account(&self, request: &Request) -> Option<Account> {
        let value = request
            .headers()
            .get(header::AUTHORIZATION)?
            .to_str()
            .ok()?;
        let key = value.strip_prefix("Bearer ")?;
        self.0.get(key.trim()).cloned()
    }
}

/// Puts the request's [`Account`] in its extensions, or answers 401 without running it.
pub(crate) async fn authenticate(
    State(keys): State<ApiKeys>,
    mut request: Request,
    next: Next,
) -> Response {
    match keys.account(&request) {
        Some(account) => {
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Json(json!({"error": "send a known API key as `Authorization: Bearer <key>`"})),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_checked_without_echoing_them() {
        let keys = ApiKeys::parse("sk_a=acct_a, sk_b = acct_b").expect("two entries");
        assert_eq!(keys.0.get("sk_b"), Some(&Account("acct_b".to_owned())));
        assert!(!format!("{keys:?}").contains("sk_"));
        for bad in [
            "sk_secret",
            "sk_secret=",
            "=acct",
            "sk_secret=a,sk_secret=b",
        ] {
            let error = ApiKeys::parse(bad).expect_err(bad);
            assert!(!error.contains("sk_secret"), "{error}");
        }
    }
}
