//! The payments example's webhook route (`POST /webhooks/provider`), as a real process on
//! PostgreSQL, called by a client that signs as the provider does (with the `hmac` crate,
//! not the ingress's own code):
//!
//! - a bad signature (another secret, a body changed after signing, no header) and a stale
//!   or future timestamp are refused with 401 problem+json and record nothing, while the
//!   same event signed right is recorded;
//! - 1,000 resends of 100 events, shuffled and sent 32 at a time, each signed when sent:
//!   exactly 100 events recorded, every answer 2xx.

use std::time::SystemTime;

use consumer_core::{Inbox, InboxConfig};
use consumer_tests::common::unique;
use consumer_tests::payments::{Answer, Payments, Server};
use futures::StreamExt;
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;

/// The example's handler name, which keys its events in the inbox.
const HANDLER: &str = "on_provider_event";

/// The signature header a provider sends: `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
fn signature(secret: &str, t: i64, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(format!("{t}.{body}").as_bytes());
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Now, in Unix seconds.
fn now() -> i64 {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    i64::try_from(secs).expect("in range")
}

/// The example with a webhook secret of its own, and that secret.
async fn start(payments: &Payments, log: &str) -> (Server, String) {
    let secret = unique("whsec");
    let server = payments.start(&[("WEBHOOK_SECRET", &secret)], log).await;
    (server, secret)
}

/// POSTs `body` to the webhook route with the signature header `signature` (none if `None`).
async fn deliver(
    payments: &Payments,
    server: &Server,
    body: &str,
    signature: Option<&str>,
) -> Answer {
    let mut request = payments
        .client()
        .post(format!("{}/webhooks/provider", server.base))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(signature) = signature {
        request = request.header("Webhook-Signature", signature);
    }
    let sent = request.send().await.expect("an answer");
    Answer::read(sent).await.expect("a body")
}

/// An event of the provider's.
fn event(i: usize) -> String {
    json!({"id": format!("evt_{i}"), "type": "charge.succeeded", "amount": i}).to_string()
}

/// The recorded events, and the distinct ids among them.
async fn recorded(payments: &Payments) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM provider_events")
        .fetch_one(payments.pool())
        .await
        .expect("count the events")
}

/// `items` in an order drawn from `seed` (Fisher–Yates over xorshift64).
fn shuffled<T>(mut items: Vec<T>, seed: u64) -> Vec<T> {
    let mut x = seed | 1;
    for i in (1..items.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = usize::try_from(x % (i as u64 + 1)).expect("an index");
        items.swap(i, j);
    }
    items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_or_stale_signature_is_refused_and_records_nothing() {
    let payments = Payments::new().await;
    let (server, secret) = start(&payments, "webhook-refused").await;
    let body = event(1);
    let t = now();
    let refused = [
        (
            "another secret",
            Some(signature("whsec_wrong", t, &body)),
            body.clone(),
        ),
        (
            "a body changed after signing",
            Some(signature(&secret, t, &body)),
            event(2),
        ),
        ("no signature", None, body.clone()),
        (
            "a stale timestamp (10 min ago)",
            Some(signature(&secret, t - 600, &body)),
            body.clone(),
        ),
        (
            "a timestamp 10 min ahead",
            Some(signature(&secret, t + 600, &body)),
            body.clone(),
        ),
    ];
    for (what, header, sent) in &refused {
        let answer = deliver(&payments, &server, sent, header.as_deref()).await;
        assert_eq!(answer.status, 401, "{what}: {answer:?}");
        answer.assert_problem(401);
    }
    assert_eq!(recorded(&payments).await, (0, 0), "nothing recorded");

    let signed = deliver(
        &payments,
        &server,
        &body,
        Some(&signature(&secret, now(), &body)),
    )
    .await;
    assert_eq!(signed.status, 200, "signed right: {signed:?}");
    assert_eq!(signed.json(), json!({"received": true}));
    assert_eq!(recorded(&payments).await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_shuffled_resends_of_a_hundred_events_record_a_hundred() {
    const EVENTS: usize = 100;
    const SENDS: usize = 10;
    let payments = Payments::new().await;
    let (server, secret) = start(&payments, "webhook-resends").await;
    let bodies: Vec<String> = (0..EVENTS).map(event).collect();
    let seed = u64::try_from(now()).expect("after 1970");
    let sends = shuffled((0..EVENTS * SENDS).map(|n| n % EVENTS).collect(), seed);
    let (payments_ref, server_ref, secret_ref, bodies_ref) = (&payments, &server, &secret, &bodies);
    let answers: Vec<(usize, Answer)> = futures::stream::iter(sends.into_iter().enumerate())
        .map(|(n, i)| async move {
            let body = &bodies_ref[i];
            // Each resend is signed anew when sent, as a provider's is, at times a little apart.
            let t = now() - i64::try_from(n % 30).expect("small");
            let signed = signature(secret_ref, t, body);
            (
                i,
                deliver(payments_ref, server_ref, body, Some(&signed)).await,
            )
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert_eq!(answers.len(), EVENTS * SENDS);
    let not_2xx: Vec<_> = answers
        .iter()
        .filter(|(_, a)| !(200..300).contains(&a.status))
        .collect();
    assert!(
        not_2xx.is_empty(),
        "seed {seed}: {} answers not 2xx, the first: {:?}",
        not_2xx.len(),
        not_2xx.first()
    );
    for (i, a) in &answers {
        assert_eq!(a.json(), json!({"received": true}), "evt_{i}: {a:?}");
    }
    assert_eq!(recorded(&payments).await, (100, 100), "seed {seed}");
    let inbox = Inbox::new(
        payments.pool().clone(),
        InboxConfig::in_schema(payments.schema().to_owned()),
    )
    .await
    .expect("the example's inbox");
    let counts = inbox.counts(HANDLER).await.expect("inbox counts");
    assert_eq!((counts.completed, counts.pending, counts.dead), (100, 0, 0));
}
