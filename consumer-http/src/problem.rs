//! The layer's own answers: `application/problem+json` bodies (RFC 9457).

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::{header, HeaderValue, StatusCode};

/// The content type of the layer's own answers.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem answer with `status`, a `title` and a `detail`, of type `about:blank`.
pub(crate) fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    typed(status, "about:blank", title, detail)
}

/// A problem answer of type `kind`.
fn typed(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": kind,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

/// A problem about the request's key: with the service's idempotency policy at `policy`
/// (see [`IdempotencyConfigBuilder::policy_url`](crate::IdempotencyConfigBuilder::policy_url)),
/// of type `<policy>#<fragment>` and with `Link: <policy>; rel="describedby"`; without one,
/// of type `about:blank`.
fn about_key(
    status: StatusCode,
    fragment: &str,
    title: &str,
    detail: &str,
    policy: Option<&str>,
) -> Response {
    let Some(policy) = policy else {
        return problem(status, title, detail);
    };
    let mut response = typed(status, &format!("{policy}#{fragment}"), title, detail);
    // A URI reference without angle brackets (checked when the configuration was built).
    if let Ok(link) = HeaderValue::from_str(&format!("<{policy}>; rel=\"describedby\"")) {
        response.headers_mut().insert(header::LINK, link);
    }
    response
}

/// 400: the key is missing or unusable.
pub(crate) fn bad_key(detail: &str, policy: Option<&str>) -> Response {
    about_key(
        StatusCode::BAD_REQUEST,
        "invalid-key",
        "Invalid Idempotency-Key",
        detail,
        policy,
    )
}

/// 401: the caller function named no caller, so the answer could be stored for no one.
pub(crate) fn no_caller() -> Response {
    problem(
        StatusCode::UNAUTHORIZED,
        "Caller not identified",
        "this request names no authenticated caller, and answers under an Idempotency-Key are kept per caller",
    )
}

/// 413: the body is over the limit.
pub(crate) fn too_large(limit: usize) -> Response {
    problem(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Request body too large",
        &format!("the body is over the limit of {limit} bytes"),
    )
}

/// 400: the body could not be read.
pub(crate) fn unreadable_body() -> Response {
    problem(
        StatusCode::BAD_REQUEST,
        "Unreadable request body",
        "the request body could not be read",
    )
}

/// 422: the key was used with another request.
pub(crate) fn mismatch(policy: Option<&str>) -> Response {
    about_key(
        StatusCode::UNPROCESSABLE_ENTITY,
        "key-reused",
        "Idempotency-Key reused",
        "this Idempotency-Key was used with another request (method, path or body)",
        policy,
    )
}

/// A problem answer with a `Retry-After` of `after`, rounded up to whole seconds (at least 1).
pub(crate) fn retry_later(
    status: StatusCode,
    title: &str,
    detail: &str,
    after: Duration,
) -> Response {
    with_retry_after(problem(status, title, detail), after)
}

/// `response` with a `Retry-After` of `after`, rounded up to whole seconds (at least 1).
fn with_retry_after(mut response: Response, after: Duration) -> Response {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    response
}

/// 409 (or, `accepted`, 202) with `Retry-After`: a request with the key is still in
/// progress. A 202 is not an error: its body has the same members, as `application/json`.
pub(crate) fn in_progress(retry_after: Duration, policy: Option<&str>, accepted: bool) -> Response {
    let status = if accepted {
        StatusCode::ACCEPTED
    } else {
        StatusCode::CONFLICT
    };
    let mut response = about_key(
        status,
        "in-progress",
        "Request in progress",
        "a request with this Idempotency-Key is still in progress; retry later",
        policy,
    );
    if accepted {
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    with_retry_after(response, retry_after)
}

/// 503 with `Retry-After`: the store failed; the request may be retried with the same key.
pub(crate) fn store_unavailable(retry_after: Duration) -> Response {
    retry_later(
        StatusCode::SERVICE_UNAVAILABLE,
        "Idempotency store unavailable",
        "the request's record could not be read or written; retry with the same key",
        retry_after,
    )
}

/// 500: the handler panicked, or its answer could not be stored.
pub(crate) fn internal(detail: &str) -> Response {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Internal Server Error",
        detail,
    )
}
