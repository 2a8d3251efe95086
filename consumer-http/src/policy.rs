//! The idempotency policy a layer keeps, written out for the service to publish (the IETF
//! draft asks a server to publish its key format, expiry policy and what makes two requests
//! the same): [`IdempotencyLayer::policy_document`](crate::IdempotencyLayer::policy_document), whose sections the problem types of the
//! layer's answers about a key point to (`#invalid-key`, `#in-progress`, `#key-reused`).

use consumer_options::format_duration;
use std::fmt::Write as _;

use crate::config::{IdempotencyConfig, MAX_IDEMPOTENCY_KEY_BYTES};

/// The policy a layer of `c` keeps, its records shared by every caller or each caller's own
/// (see [`IdempotencyLayer::policy_document`](crate::IdempotencyLayer::policy_document)).
pub(crate) fn document(c: &IdempotencyConfig, shared_across_callers: bool) -> String {
    let methods: Vec<&str> = c.methods.iter().map(http::Method::as_str).collect();
    let stored_headers: Vec<&str> = c.stored_headers.iter().map(|h| h.as_str()).collect();
    let mut d = String::new();
    // Writing to a String does not fail.
    let _ = writeln!(d, "# Idempotency policy\n");
    let _ = writeln!(
        d,
        "Requests with the methods {} take an `Idempotency-Key` header \
         ([draft-ietf-httpapi-idempotency-key-header]). {}\n",
        methods.join(", "),
        if c.key_required {
            "A request without one is refused."
        } else {
            "A request without one runs as it is, every time it is sent."
        }
    );
    let _ = writeln!(d, "## Key\n");
    let _ = writeln!(
        d,
        "A Structured Field string, `Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"`; \
         the bare form, without quotes, is the same key. At most {MAX_IDEMPOTENCY_KEY_BYTES} \
         bytes of printable ASCII; format: {}. Use a new key for each new request, and the \
         same key when you send a request again.\n",
        c.key_format.description()
    );
    let _ = writeln!(d, "## Scope\n");
    let _ = writeln!(
        d,
        "{}\n",
        if shared_across_callers {
            "A key is one per route (method and path), whoever sends it."
        } else {
            "A key is the authenticated caller's own, per route (method and path): what one \
             caller stored, another cannot read."
        }
    );
    let _ = writeln!(d, "## Fingerprint\n");
    let _ = writeln!(
        d,
        "Two requests with one key are the same request when their method, path and query, \
         and body are the same; a JSON body by its content (key order and white space do \
         not matter).\n"
    );
    let _ = writeln!(d, "## Expiry\n");
    let _ = writeln!(
        d,
        "The answer to a key is kept for {} after it was given; after that the key is \
         free and a request with it runs again.\n",
        format_duration(c.ttl)
    );
    let _ = writeln!(d, "## Answers\n");
    let _ = writeln!(
        d,
        "- The first request runs. Its answer is stored if it is a 2xx or a 3xx{}; never \
         a 5xx, 408, 409, 425 or 429: the request then had no effect, and sending it again \
         runs it.",
        if c.store_client_errors {
            ", or a 4xx"
        } else {
            " (a 4xx is not stored either)"
        }
    );
    let _ = writeln!(
        d,
        "- The same request again: the stored answer (status, body, {}), with \
         `Idempotent-Replayed: true`.",
        stored_headers.join(", ")
    );
    let _ = writeln!(
        d,
        "- <a id=\"in-progress\"></a>**409 Conflict** (`#in-progress`): the first request \
         with the key still runs after a wait of {}; send it again after `Retry-After`.",
        format_duration(c.wait)
    );
    let _ = writeln!(
        d,
        "- <a id=\"key-reused\"></a>**422 Unprocessable Content** (`#key-reused`): the key \
         was used with another request (another fingerprint). Sending it again unchanged \
         gets the same answer: use a new key."
    );
    let _ = writeln!(
        d,
        "- <a id=\"invalid-key\"></a>**400 Bad Request** (`#invalid-key`): the key is \
         missing, repeated or not of the format above. Sending it again unchanged gets the \
         same answer.\n"
    );
    let _ = writeln!(
        d,
        "[draft-ietf-httpapi-idempotency-key-header]: \
         https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/"
    );
    d
}

#[cfg(test)]
mod tests {
    use super::document;
    use crate::IdempotencyConfig;

    /// The repository's page is the policy of the default configuration, each caller's
    /// records their own: regenerate it with `POLICY_WRITE=1 cargo test -p consumer-http
    /// --lib policy` when the document changes.
    #[test]
    fn the_repositorys_policy_page_is_the_default_configurations() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/idempotency-policy.md");
        let written = document(&IdempotencyConfig::default(), false);
        if std::env::var_os("POLICY_WRITE").is_some() {
            std::fs::write(path, &written).expect("write the policy page");
        }
        let page = std::fs::read_to_string(path).expect("docs/idempotency-policy.md");
        assert_eq!(page, written, "docs/idempotency-policy.md is out of date");
    }
}
