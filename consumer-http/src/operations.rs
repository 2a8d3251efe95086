//! Long operations: a request that starts work it does not finish answers `202 Accepted`
//! with an operation id, and the client polls the operation's status.
//!
//! - The handler starts the operation in the request's transaction
//!   ([`IdempotentTx::start_operation`](crate::IdempotentTx::start_operation)), so it
//!   exists exactly when the stored answer does: a retry of the request is answered the
//!   same 202 and id, and a request that rolled back left no operation behind.
//! - Whoever does the work (a background task, a queue handler, another process) reads the
//!   pending operations ([`Operations::pending`]) and finishes each in its own transaction
//!   ([`Operations::succeed`], [`Operations::fail`]), with its effects: an operation is
//!   finished once, and a second finish is refused.
//! - The status route ([`IdempotencyLayer::operations_router`](crate::IdempotencyLayer::operations_router))
//!   answers `GET <path>/<id>` to the caller that started it, and `404` to any other.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use crate::caller::{Callers, NoCaller};
use crate::problem;
use crate::store::{Names, StoreBackend};
pub use crate::store::{Operation, OperationStatus, Operations};
use crate::Error;

/// An operation a request started
/// ([`IdempotentTx::start_operation`](crate::IdempotentTx::start_operation)): answer with
/// [`StartedOperation::accepted`].
#[derive(Debug, Clone)]
pub struct StartedOperation {
    id: String,
    location: String,
    retry_after: Duration,
}

impl StartedOperation {
    /// Its id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where its status is read: the layer's
    /// [`operations_path`](crate::IdempotencyConfigBuilder::operations_path), then the id.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// `202 Accepted` with `Location` (the status route), `Retry-After` (the layer's
    /// [`retry_after`](crate::IdempotencyConfigBuilder::retry_after)) and the JSON body
    /// `{"operation_id": …, "status": "pending"}`. The layer stores it as any answer (keep
    /// `location` among the [stored headers](crate::IdempotencyConfigBuilder::stored_headers),
    /// as the default does), so a retry gets the same 202 and id.
    pub fn accepted(&self) -> Response {
        let body = serde_json::json!({"operation_id": self.id, "status": "pending"});
        let mut response = json(StatusCode::ACCEPTED, &body);
        let headers = response.headers_mut();
        if let Ok(location) = HeaderValue::from_str(&self.location) {
            headers.insert(header::LOCATION, location);
        }
        headers.insert(header::RETRY_AFTER, retry_after_seconds(self.retry_after));
        response
    }
}

/// `value` as an `application/json` answer of `status`.
fn json(status: StatusCode, value: &serde_json::Value) -> Response {
    let mut response = (status, value.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `Retry-After` in whole seconds, at least 1.
fn retry_after_seconds(after: Duration) -> HeaderValue {
    HeaderValue::from(after.as_secs().max(1) + u64::from(after.subsec_nanos() > 0))
}

/// What the layer's requests start operations with: the store's statements, where the
/// status route is and the `Retry-After` of a 202. Built once with the layer; a request's
/// transaction holds a clone (two reference counts), and what the request adds
/// ([`StartedBy`]) is borrowed only when the handler starts an operation.
pub(crate) struct Starter<DB: StoreBackend> {
    names: Arc<Names>,
    path: Arc<str>,
    retry_after: Duration,
    _db: std::marker::PhantomData<fn() -> DB>,
}

impl<DB: StoreBackend> Clone for Starter<DB> {
    fn clone(&self) -> Self {
        Starter {
            names: self.names.clone(),
            path: self.path.clone(),
            retry_after: self.retry_after,
            _db: std::marker::PhantomData,
        }
    }
}

/// The request that starts an operation, as its transaction holds it.
pub(crate) struct StartedBy<'a> {
    /// The caller part of the request's scope: who may read the operation.
    pub(crate) owner: &'a str,
    /// The request's claim token, unique to it: the operations' ids derive from it.
    pub(crate) claim: &'a str,
    /// How many operations the request started before this one.
    pub(crate) n: u64,
}

impl<DB: StoreBackend> Starter<DB> {
    /// The starter of a layer on a store of `names`, whose status route is under `path`.
    pub(crate) fn new(names: Arc<Names>, path: &str, retry_after: Duration) -> Self {
        Starter {
            names,
            path: path.into(),
            retry_after,
            _db: std::marker::PhantomData,
        }
    }

    /// Starts an operation of `kind` on `input` in the request's transaction `conn`.
    pub(crate) async fn start(
        &self,
        conn: &mut DB::Connection,
        by: StartedBy<'_>,
        kind: &str,
        input: &serde_json::Value,
    ) -> Result<StartedOperation, Error> {
        let digest = Sha256::digest(format!("{}:{}:{kind}", by.claim, by.n));
        let id = format!("op_{}", hex::encode(&digest[..16]));
        let input = serde_json::to_vec(input)
            .map_err(|e| Error::Database(sqlx::Error::Encode(Box::new(e))))?;
        DB::op_insert(conn, &self.names.sql, [&id, by.owner, kind], &input).await?;
        Ok(StartedOperation {
            location: format!("{}/{id}", self.path),
            id,
            retry_after: self.retry_after,
        })
    }
}

/// The status route's answer about `op`.
fn status_body(op: &Operation) -> serde_json::Value {
    let millis = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    let mut body = serde_json::json!({
        "operation_id": op.id,
        "kind": op.kind,
        "status": op.status.as_str(),
        "created_at_ms": millis(op.created),
        "updated_at_ms": millis(op.updated),
    });
    let field = match op.status {
        OperationStatus::Pending => None,
        OperationStatus::Succeeded => Some("result"),
        OperationStatus::Failed => Some("error"),
    };
    if let (Some(field), Some(result)) = (field, &op.result) {
        body[field] = result.clone();
    }
    body
}

/// The status route's state.
pub(crate) struct StatusRoute<DB: StoreBackend> {
    pub(crate) operations: Operations<DB>,
    pub(crate) callers: Callers,
    pub(crate) retry_after: Duration,
}

impl<DB: StoreBackend> Clone for StatusRoute<DB> {
    fn clone(&self) -> Self {
        StatusRoute {
            operations: self.operations.clone(),
            callers: self.callers.clone(),
            retry_after: self.retry_after,
        }
    }
}

/// `GET <path>/<id>`: the operation, to the caller that started it (`404` to any other,
/// as for an id that does not exist); `Retry-After` while it is pending.
pub(crate) async fn status<DB: StoreBackend>(
    State(route): State<StatusRoute<DB>>,
    Path(id): Path<String>,
    request: axum::extract::Request,
) -> Response {
    let (parts, _) = request.into_parts();
    let owner = match route.callers.of(&parts) {
        Ok(caller) => crate::request::caller_part(caller.as_deref()),
        Err(NoCaller) => return problem::no_caller(),
    };
    let operation = match route.operations.get(&id).await {
        Ok(operation) => operation,
        Err(e) => {
            tracing::warn!(error = %e, "reading an operation failed");
            return problem::store_unavailable(route.retry_after);
        }
    };
    match operation {
        Some(op) if op.owner == owner => {
            let mut response = json(StatusCode::OK, &status_body(&op));
            if op.status == OperationStatus::Pending {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, retry_after_seconds(route.retry_after));
            }
            response
        }
        _ => problem::problem(
            StatusCode::NOT_FOUND,
            "No such operation",
            "no operation of this caller has this id",
        ),
    }
}
