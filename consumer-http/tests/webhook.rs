//! The webhook ingress end to end, on the harness of `common::webhook` (its router on
//! `127.0.0.1:0`, a worker on its transport, a client signing like a provider, PostgreSQL).

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::webhook::{assert_problem, now, signature, Ingress, HANDLER, OLD_SECRET, SECRET};
use common::{wait_until, Answer};
use consumer_core::inbox::EntryStatus;
use consumer_http::webhook::DEFAULT_SIGNATURE_HEADER;
use consumer_http::WebhookIngressBuilder;
use futures::StreamExt;
use serde_json::{json, Value};

/// A signed event is answered 200 once its effect committed; its resends, signed at other
/// times and under the rotated-out secret, are 200 and run nothing.
#[tokio::test]
async fn a_signed_event_runs_once_and_its_resends_are_answered_2xx() {
    let mut ingress = Ingress::start(|b| b).await;
    let body = json!({"id": "evt_1", "type": "charge.succeeded", "amount": 100}).to_string();
    let first = ingress
        .post(&body, Some(&signature(SECRET, now(), &body)), &[])
        .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.json(), json!({"received": true}));
    // The answer came after the commit: the effect is there now, no waiting.
    assert_eq!(ingress.effects().await, (1, 1));
    for signed in [
        signature(SECRET, now() - 60, &body),
        signature(OLD_SECRET, now(), &body),
        // A provider signing with both secrets while it rotates.
        format!(
            "{},v1={}",
            signature(OLD_SECRET, now(), &body),
            signature("whsec_unknown", now(), &body)
                .split_once(",v1=")
                .unwrap()
                .1
        ),
    ] {
        let again = ingress.post(&body, Some(&signed), &[]).await;
        assert_eq!(again.status, 200, "{again:?}");
    }
    assert_eq!(ingress.effects().await, (1, 1));
    assert_eq!(
        ingress.entry_status("evt_1").await,
        Some((EntryStatus::Completed, 1))
    );
    let stats = ingress.worker.snapshot();
    assert_eq!(
        (stats.completed, stats.duplicates, stats.handler_runs),
        (1, 3, 1)
    );
    ingress.stop_worker().await;
}

/// Bad and missing signatures, stale and future timestamps, bodies over the limit, bodies
/// that are not JSON or have no event id: each answered before the inbox, which has no row
/// afterwards, and the worker never received any of them.
#[tokio::test]
async fn refused_requests_never_reach_the_inbox() {
    let mut ingress = Ingress::start(|b| b.max_body_bytes(1024)).await;
    let body = json!({"id": "evt_refused", "amount": 1}).to_string();
    let t = now();
    let cases: Vec<(&str, String, Option<String>, u16)> = vec![
        (
            "signed with an unknown secret",
            body.clone(),
            Some(signature("whsec_attacker", t, &body)),
            401,
        ),
        ("no signature header", body.clone(), None, 401),
        (
            "signature of another body",
            body.clone(),
            Some(signature(
                SECRET,
                t,
                r#"{"id":"evt_refused","amount":1000}"#,
            )),
            401,
        ),
        (
            "malformed signature header",
            body.clone(),
            Some("v1=deadbeef".to_owned()),
            401,
        ),
        (
            "stale timestamp, valid signature",
            body.clone(),
            Some(signature(SECRET, t - 301, &body)),
            401,
        ),
        (
            "future timestamp, valid signature",
            body.clone(),
            Some(signature(SECRET, t + 400, &body)),
            401,
        ),
        (
            "body over the limit, valid signature",
            json!({"id": "evt_big", "pad": "x".repeat(2048)}).to_string(),
            None,
            413,
        ),
        (
            "not JSON, valid signature",
            "id=evt_form".to_owned(),
            None,
            400,
        ),
        (
            "no event id, valid signature",
            json!({"type": "charge.succeeded"}).to_string(),
            None,
            400,
        ),
        (
            "an event id that is not a string, valid signature",
            json!({"id": {"nested": true}}).to_string(),
            None,
            400,
        ),
    ];
    for (what, body, signed, status) in cases {
        // `None` for a case that is about the body: sign it correctly.
        let signed = match (signed, status) {
            (None, 413 | 400) => Some(signature(SECRET, now(), &body)),
            (signed, _) => signed,
        };
        let answer = ingress.post(&body, signed.as_deref(), &[]).await;
        assert_eq!(answer.status, status, "{what}: {answer:?}");
        assert_problem(&answer, status);
        assert_eq!(answer.json()["status"], json!(status), "{what}");
    }
    // A second signature header is refused too, even if one of them is right.
    let answer = ingress
        .post(
            &body,
            Some(&signature(SECRET, now(), &body)),
            &[(DEFAULT_SIGNATURE_HEADER, "t=1,v1=00")],
        )
        .await;
    assert_problem(&answer, 401);

    assert_eq!(ingress.inbox_rows().await, 0);
    assert_eq!(ingress.effects().await, (0, 0));
    // One good event through the same pipeline: it is the only one the worker received.
    let good = ingress.deliver(&json!({"id": "evt_good"})).await;
    assert_eq!(good.status, 200, "{good:?}");
    let stats = ingress.worker.snapshot();
    assert_eq!((stats.received, stats.handler_runs), (1, 1));
    assert_eq!(ingress.inbox_rows().await, 1);
    assert_eq!(ingress.effects().await, (1, 1));
    ingress.stop_worker().await;
}

/// The acceptance run: 100 events, each sent 10 times, the 1,000 requests interleaved and
/// 32 at a time, each signed when sent: exactly 100 effects, one per event, and every
/// answer 2xx.
#[tokio::test]
async fn a_thousand_interleaved_resends_of_a_hundred_events_make_a_hundred_effects() {
    const EVENTS: usize = 100;
    const SENDS: usize = 10;
    let mut ingress = Ingress::start(|b| b).await;
    let bodies: Vec<String> = (0..EVENTS)
        .map(|i| json!({"id": format!("evt_{i}"), "type": "invoice.paid", "amount": i}).to_string())
        .collect();
    // A fixed permutation of the 1,000 sends (7 is coprime with 1,000): resends of one
    // event are spread over the run and race each other and the first send.
    let total = EVENTS * SENDS;
    let order: Vec<usize> = (0..total).map(|n| (n * 7 + 3) % total).collect();
    let ingress_ref = &ingress;
    let bodies_ref = &bodies;
    let answers: Vec<Answer> = futures::stream::iter(order)
        .map(|n| async move {
            let body = &bodies_ref[n % EVENTS];
            // Each resend is signed anew, as a provider's is, at a slightly different time.
            let t = now() - i64::try_from(n % 30).unwrap();
            ingress_ref
                .post(body, Some(&signature(SECRET, t, body)), &[])
                .await
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert_eq!(answers.len(), total);
    let not_2xx: Vec<_> = answers
        .iter()
        .filter(|a| !(200..300).contains(&a.status))
        .collect();
    assert!(
        not_2xx.is_empty(),
        "{} answers not 2xx: {:?}",
        not_2xx.len(),
        not_2xx.first()
    );
    assert_eq!(ingress.effects().await, (100, 100));
    let counts = ingress.inbox.counts(HANDLER).await.unwrap();
    assert_eq!((counts.completed, counts.pending, counts.dead), (100, 0, 0));
    let stats = ingress.worker.snapshot();
    assert_eq!(stats.received, 1000);
    assert_eq!(stats.completed, 100);
    assert_eq!(stats.duplicates, 900);
    assert_eq!(stats.handler_runs, 100);
    ingress.stop_worker().await;
}

/// A handler that fails transiently: the first answer is 503 with `Retry-After` and the
/// failed attempt's write rolled back; the provider's resend is the retry, counted by the
/// inbox as attempt 2, and answered 200 with one effect.
#[tokio::test]
async fn a_transient_failure_is_answered_503_and_the_resend_runs_it() {
    let mut ingress = Ingress::start(|b| b).await;
    let event = json!({"id": "evt_flaky", "fail_before_attempt": 2});
    let first = ingress.deliver(&event).await;
    assert_problem(&first, 503);
    let retry_after: u64 = first.header("retry-after").unwrap().parse().unwrap();
    assert!(retry_after >= 1, "{first:?}");
    assert_eq!(ingress.effects().await, (0, 0));
    assert_eq!(
        ingress.entry_status("evt_flaky").await,
        Some((EntryStatus::Pending, 1))
    );
    let resend = ingress.deliver(&event).await;
    assert_eq!(resend.status, 200, "{resend:?}");
    assert_eq!(ingress.effects().await, (1, 1));
    assert_eq!(
        ingress.entry_status("evt_flaky").await,
        Some((EntryStatus::Completed, 2))
    );
    let again = ingress.deliver(&event).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(ingress.effects().await, (1, 1));
    ingress.stop_worker().await;
}

/// What a resend cannot fix is dead-lettered and answered 2xx, so the provider stops: the
/// same event id with another body (a key conflict: the first body's effect stays, the
/// inbox row stays completed), and a permanent failure (the row is dead, and a resend is
/// answered 2xx from it without running).
#[tokio::test]
async fn what_a_resend_cannot_fix_is_dead_lettered_and_answered_2xx() {
    let mut ingress = Ingress::start(|b| b).await;
    let first = ingress
        .deliver(&json!({"id": "evt_same", "amount": 1}))
        .await;
    assert_eq!(first.status, 200, "{first:?}");
    let other = ingress
        .deliver(&json!({"id": "evt_same", "amount": 2}))
        .await;
    assert_eq!(other.status, 200, "{other:?}");
    assert_eq!(
        other.json(),
        json!({"received": true, "dead_lettered": "key_conflict"})
    );
    assert_eq!(ingress.effects().await, (1, 1));
    let body: String = sqlx::query_scalar("SELECT body FROM effects")
        .fetch_one(&ingress.pool)
        .await
        .unwrap();
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["amount"], 1);
    assert_eq!(
        ingress.entry_status("evt_same").await,
        Some((EntryStatus::Completed, 1))
    );

    let poison = json!({"id": "evt_poison", "permanent": true});
    for _ in 0..2 {
        let answer = ingress.deliver(&poison).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(
            answer.json(),
            json!({"received": true, "dead_lettered": "permanent_error"})
        );
    }
    assert_eq!(
        ingress.entry_status("evt_poison").await,
        Some((EntryStatus::Dead, 1))
    );
    let stats = ingress.worker.snapshot();
    assert_eq!(stats.conflicts, 1);
    assert_eq!(stats.dead_lettered, 3);
    // The first event's run and the poison event's one run.
    assert_eq!(stats.handler_runs, 2);
    assert_eq!(ingress.effects().await, (1, 1));
    ingress.stop_worker().await;
}

/// The event id read from a header: resends with the same id run once; a request without
/// the header is 400 and reaches nothing.
#[tokio::test]
async fn the_event_id_can_come_from_a_header() {
    let mut ingress = Ingress::start(|b| b.event_id_header("webhook-id")).await;
    let body = json!({"type": "ping"}).to_string();
    for _ in 0..3 {
        let answer = ingress
            .post(
                &body,
                Some(&signature(SECRET, now(), &body)),
                &[("webhook-id", "msg_1")],
            )
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    let missing = ingress
        .post(&body, Some(&signature(SECRET, now(), &body)), &[])
        .await;
    assert_problem(&missing, 400);
    assert_eq!(ingress.effects().await, (1, 1));
    assert_eq!(
        ingress.entry_status("msg_1").await,
        Some((EntryStatus::Completed, 1))
    );
    ingress.stop_worker().await;
}

/// With the worker stopped, a signed event is answered 503 with `Retry-After`: the
/// provider keeps it and resends it later.
#[tokio::test]
async fn without_a_worker_events_are_answered_503() {
    let mut ingress = Ingress::start(|b| b).await;
    ingress.stop_worker().await;
    let answer = ingress.deliver(&json!({"id": "evt_late"})).await;
    assert_problem(&answer, 503);
    assert!(answer.header("retry-after").is_some(), "{answer:?}");
    assert_eq!(ingress.inbox_rows().await, 0);
    assert_eq!(ingress.worker.snapshot().received, 0);
}

/// A request whose client hangs up before the answer loses nothing: the worker still runs
/// the event and commits it, and the provider's resend is answered 200 as a duplicate.
#[tokio::test]
async fn a_request_dropped_before_its_answer_still_commits_once() {
    let mut ingress = Ingress::start(|b| b).await;
    let body = json!({"id": "evt_slow", "hold_ms": 500}).to_string();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let sent = impatient
        .post(&ingress.base)
        .header("content-type", "application/json")
        .header(DEFAULT_SIGNATURE_HEADER, signature(SECRET, now(), &body))
        .body(body.clone())
        .send()
        .await;
    assert!(
        sent.is_err_and(|e| e.is_timeout()),
        "the client was to give up"
    );
    wait_until("the dropped request's effect", || async {
        ingress.effects().await == (1, 1)
    })
    .await;
    let resend = ingress
        .post(&body, Some(&signature(SECRET, now(), &body)), &[])
        .await;
    assert_eq!(resend.status, 200, "{resend:?}");
    assert_eq!(ingress.effects().await, (1, 1));
    let stats = ingress.worker.snapshot();
    assert_eq!((stats.handler_runs, stats.settle_errors), (1, 0));
    ingress.stop_worker().await;
}

/// With `payload_hash_ids`, an event without an id is keyed by its body's canonical hash: its
/// resends, one with its keys in another order and other white space, are answered 200 and
/// run nothing; an event with another body runs. Without it, such an event is 400.
#[tokio::test]
async fn an_event_without_an_id_is_keyed_by_its_payload_when_asked() {
    let mut ingress = Ingress::start(WebhookIngressBuilder::payload_hash_ids).await;
    let event = r#"{"kind": "payment.paid", "amount": 5, "at": 1700000000}"#;
    let reordered = r#"{ "at": 1700000000, "amount": 5,   "kind": "payment.paid" }"#;
    for body in [event, event, reordered] {
        let answer = ingress
            .post(body, Some(&signature(SECRET, now(), body)), &[])
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    let other = r#"{"kind": "payment.paid", "amount": 5, "at": 1700000001}"#;
    let answer = ingress
        .post(other, Some(&signature(SECRET, now(), other)), &[])
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(ingress.effects().await, (2, 2));
    ingress.stop_worker().await;

    let strict = Ingress::start(|b| b).await;
    let refused = strict
        .post(event, Some(&signature(SECRET, now(), event)), &[])
        .await;
    assert_problem(&refused, 400);
    assert_eq!(strict.effects().await, (0, 0));
}
