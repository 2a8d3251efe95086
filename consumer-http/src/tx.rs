//! [`IdempotentTx`]: the request's transaction, in which the layer stores the answer.

use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::Response;
use http::request::Parts;
use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::operations::{StartedBy, StartedOperation, Starter};
use crate::problem;
use crate::request;
use crate::store::StoreBackend;

/// Where the layer keeps the request's transaction while the handler runs: the handler
/// borrows it through [`IdempotentTx`], the layer takes it back to store the answer and
/// commit. With it, the record the request holds (its scope and key), for the handler's
/// stable keys ([`IdempotentTx::idempotency_key`]), and its claim token and the layer's
/// [`Starter`], for the operations the handler starts.
pub(crate) struct TxSlot<DB: StoreBackend> {
    tx: Arc<Mutex<InTx<DB>>>,
    request: RequestIds,
    starter: Starter<DB>,
}

impl<DB: StoreBackend> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        TxSlot {
            tx: self.tx.clone(),
            request: self.request.clone(),
            starter: self.starter.clone(),
        }
    }
}

/// What the slot's lock guards: the transaction until the layer takes it back, and how many
/// operations the request started in it (their ids count them).
struct InTx<DB: StoreBackend> {
    tx: Option<Transaction<'static, DB>>,
    operations_started: u64,
}

/// The request's record and claim token, in the one string the request allocates for them.
#[derive(Clone)]
struct RequestIds {
    /// The record (`<scope length>:<scope>:<key>`: length-prefixed, so no scope and key run
    /// into another pair), then the claim token.
    text: Arc<str>,
    /// Where the record ends and the claim begins.
    record_end: usize,
    /// Where the caller part of the scope is, in the record.
    owner: Range<usize>,
}

impl RequestIds {
    fn new(scope: &str, key: &str, claim: &str) -> Self {
        let prefix = format!("{}:", scope.len());
        let owner = prefix.len()..prefix.len() + request::caller_part_of(scope).len();
        let text = format!("{prefix}{scope}:{key}{claim}");
        RequestIds {
            record_end: text.len() - claim.len(),
            text: text.into(),
            owner,
        }
    }

    fn record(&self) -> &str {
        &self.text[..self.record_end]
    }

    fn claim(&self) -> &str {
        &self.text[self.record_end..]
    }

    fn owner(&self) -> &str {
        &self.text[self.owner.clone()]
    }
}

impl<DB: StoreBackend> TxSlot<DB> {
    /// The slot of `tx`, which holds the record of (`scope`, `key`) under `claim`, and
    /// starts operations with `starter`.
    pub(crate) fn new(
        tx: Transaction<'static, DB>,
        scope: &str,
        key: &str,
        claim: &str,
        starter: Starter<DB>,
    ) -> Self {
        TxSlot {
            tx: Arc::new(Mutex::new(InTx {
                tx: Some(tx),
                operations_started: 0,
            })),
            request: RequestIds::new(scope, key, claim),
            starter,
        }
    }

    /// The transaction back from the handler; `None` if the handler still holds it (it
    /// kept its [`IdempotentTx`] past its answer, e.g. in a spawned task).
    pub(crate) fn take(&self) -> Option<Transaction<'static, DB>> {
        self.tx.try_lock().ok().and_then(|mut slot| slot.tx.take())
    }
}

/// The transaction the [`IdempotencyLayer`](crate::IdempotencyLayer) stores the answer in,
/// for a handler's writes: they commit together with the stored answer, or neither does.
///
/// Dereferences to the database connection, so `sqlx::query(..).execute(&mut *tx)` runs in
/// it. Do not commit it: the layer commits after storing the answer, and rolls back if the
/// handler answers 5xx, 408, 409, 425 or 429 (or any 4xx with
/// [`store_client_errors(false)`](crate::IdempotencyConfigBuilder::store_client_errors)),
/// panics, or the answer cannot be stored.
///
/// Extracting it on a request the layer did not claim (another method, no key where the
/// key is optional, a route without the layer) is answered 500.
pub struct IdempotentTx<DB: StoreBackend> {
    guard: OwnedMutexGuard<InTx<DB>>,
    request: RequestIds,
    starter: Starter<DB>,
}

impl<DB: StoreBackend> IdempotentTx<DB> {
    /// A stable key for an effect outside the database, e.g. the `Idempotency-Key` this
    /// handler sends a payment provider: the same on every run of this request's key (a
    /// retry that runs again after a rollback, or after the process died mid-request), other
    /// for another `effect`, another key, another caller or another route. `ik-` and 64 hex
    /// characters, as a queue handler's
    /// [`Context::idempotency_key`](consumer_core::Context::idempotency_key).
    pub fn idempotency_key(&self, effect: &str) -> String {
        consumer_core::idempotency_key("http", self.request.record(), effect)
    }

    /// Starts a long operation of `kind` on `input`, in this transaction: it exists once
    /// the request's answer is stored, and not at all if the request rolls back. Answer
    /// with [`StartedOperation::accepted`] (202, `Location` of its status, `Retry-After`);
    /// whoever does the work finishes it through
    /// [`IdempotencyStore::operations`](crate::IdempotencyStore::operations). Its status is
    /// served to the caller that started it (see [`crate::operations`]).
    pub async fn start_operation(
        &mut self,
        kind: &str,
        input: &serde_json::Value,
    ) -> Result<StartedOperation, crate::Error> {
        let InTx {
            tx,
            operations_started,
        } = &mut *self.guard;
        let Some(tx) = tx.as_mut() else {
            unreachable!("checked when extracted; the layer takes it only after")
        };
        let by = StartedBy {
            owner: self.request.owner(),
            claim: self.request.claim(),
            n: *operations_started,
        };
        *operations_started += 1;
        self.starter.start(&mut **tx, by, kind, input).await
    }
}

impl<DB: StoreBackend> std::fmt::Debug for IdempotentTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx")
            .field("backend", &DB::BACKEND)
            .finish_non_exhaustive()
    }
}

impl<S: Send + Sync, DB: StoreBackend> FromRequestParts<S> for IdempotentTx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let missing = || {
            problem::internal(
                "this request has no idempotency transaction: the route lacks the \
                 IdempotencyLayer, or the request is not one it claims",
            )
        };
        let slot = parts
            .extensions
            .get::<TxSlot<DB>>()
            .cloned()
            .ok_or_else(missing)?;
        let guard = slot.tx.lock_owned().await;
        if guard.tx.is_none() {
            return Err(missing());
        }
        Ok(IdempotentTx {
            guard,
            request: slot.request,
            starter: slot.starter,
        })
    }
}

impl<DB: StoreBackend> Deref for IdempotentTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match self.guard.tx.as_ref() {
            Some(tx) => tx,
            None => unreachable!("checked when extracted; the layer takes it only after"),
        }
    }
}

impl<DB: StoreBackend> DerefMut for IdempotentTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match self.guard.tx.as_mut() {
            Some(tx) => tx,
            None => unreachable!("checked when extracted; the layer takes it only after"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RequestIds;

    #[test]
    fn the_request_ids_split_back_into_record_owner_and_claim() {
        for (scope, key, claim) in [
            ("c:ab12|POST /payments", "k-1", "00ff-1a-2"),
            ("-|POST /a:b", "x:y", "claim"),
            ("c:|PATCH /", "", ""),
        ] {
            let ids = RequestIds::new(scope, key, claim);
            // The record as the handler's stable keys have always been derived from.
            assert_eq!(ids.record(), format!("{}:{scope}:{key}", scope.len()));
            assert_eq!(ids.owner(), crate::request::caller_part_of(scope));
            assert_eq!(ids.claim(), claim);
        }
    }
}
