//! The layer end to end: an axum app on `127.0.0.1:0`, a reqwest client, PostgreSQL
//! (`DATABASE_URL`, a fresh schema per test) and SQLite (a temporary file). Every scenario
//! runs on both, and on PostgreSQL with the Redis fast path in front (`REDIS_URL`), whose
//! own tests are in `redis.rs`.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{App, Db, Scoping, ALICE, BOB, CAROL};
use consumer_http::IdempotencyConfig;
use serde_json::json;

fn config() -> consumer_http::IdempotencyConfigBuilder {
    IdempotencyConfig::builder().stored_headers([axum::http::HeaderName::from_static("location")])
}

/// 100 concurrent requests with one key: the handler runs once and its row commits once;
/// every other answer is the stored one, byte for byte, marked replayed, or a 409.
async fn concurrent_requests_with_one_key_run_once(db: Db) {
    let app =
        Arc::new(App::serve(&db, config().wait(Duration::from_secs(30)).build().unwrap()).await);
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 100});
    let requests: Vec<_> = (0..100)
        .map(|_| {
            let (app, body) = (app.clone(), body.clone());
            tokio::spawn(async move { app.post("/payments", Some("pay-1"), &body).await })
        })
        .collect();
    // The first run waits at the gate while the others arrive.
    app.wait_held(1).await;
    app.open_gate();
    let mut answers = Vec::new();
    for r in requests {
        answers.push(r.await.expect("request task"));
    }
    assert_eq!(app.runs(), 1);
    assert_eq!(db.effects().await, 1);
    let first: Vec<_> = answers
        .iter()
        .filter(|a| !a.replayed() && a.status == 201)
        .collect();
    assert_eq!(first.len(), 1, "{answers:?}");
    let first = first[0].clone();
    assert_eq!(first.header("x-not-stored"), Some("1"));
    let (mut replays, mut conflicts) = (0, 0);
    for a in &answers {
        match a.status {
            201 if a.replayed() => {
                replays += 1;
                assert_eq!(a.body, first.body);
                assert_eq!(a.header("content-type"), first.header("content-type"));
                assert_eq!(a.header("location"), first.header("location"));
                assert_eq!(a.header("x-not-stored"), None);
            }
            201 => {}
            409 => {
                conflicts += 1;
                a.assert_problem(409);
                assert!(a.header("retry-after").is_some(), "{a:?}");
            }
            _ => panic!("unexpected answer {a:?}"),
        }
    }
    assert_eq!(replays + conflicts, 99);
    let again = app.post("/payments", Some("pay-1"), &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(db.effects().await, 1);
}

/// A request that waits for the one in progress gets its answer; one with another body under
/// the key is 422 at once, while the first is still in progress and after it completed.
async fn a_request_in_progress_is_waited_for(db: Db) {
    let app =
        Arc::new(App::serve(&db, config().wait(Duration::from_secs(30)).build().unwrap()).await);
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 5});
    let first = tokio::spawn({
        let (app, body) = (app.clone(), body.clone());
        async move { app.post("/payments", Some("k"), &body).await }
    });
    app.wait_held(1).await;
    let second = tokio::spawn({
        let (app, body) = (app.clone(), body.clone());
        async move { app.post("/payments", Some("k"), &body).await }
    });
    let other = app
        .post("/payments", Some("k"), &json!({"amount": 6}))
        .await;
    other.assert_problem(422);
    app.open_gate();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert!(second.replayed(), "{second:?}");
    assert_eq!(second.body, first.body);
    let other = app
        .post("/payments", Some("k"), &json!({"amount": 6}))
        .await;
    other.assert_problem(422);
    assert_eq!(app.runs(), 1);
    assert_eq!(db.effects().await, 1);
}

/// The fingerprint: the same JSON in another key order and spacing is a replay; another
/// body is 422 and runs nothing; the same key on another route or from another caller is
/// another record.
async fn the_key_is_bound_to_its_request_route_and_caller(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    let first = app
        .send(
            "/payments",
            Some("k"),
            r#"{"amount":1,"currency":"EUR"}"#.into(),
            &[],
        )
        .await;
    assert_eq!(first.status, 201);
    let reordered = app
        .send(
            "/payments",
            Some("k"),
            r#"{ "currency": "EUR",  "amount": 1 }"#.into(),
            &[],
        )
        .await;
    assert!(reordered.replayed(), "{reordered:?}");
    assert_eq!(reordered.body, first.body);
    let other = app
        .post(
            "/payments",
            Some("k"),
            &json!({"amount": 2, "currency": "EUR"}),
        )
        .await;
    other.assert_problem(422);
    assert_eq!(db.effects().await, 1);
    let other_route = app.post("/flaky", Some("k"), &json!({})).await;
    assert_eq!(other_route.status, 201);
    assert!(!other_route.replayed());
    let body = r#"{"amount":1,"currency":"EUR"}"#;
    let bobs = app
        .send(
            "/payments",
            Some("k"),
            body.into(),
            &[("authorization", BOB)],
        )
        .await;
    let carols = app
        .send(
            "/payments",
            Some("k"),
            body.into(),
            &[("authorization", CAROL)],
        )
        .await;
    assert!(!bobs.replayed() && !carols.replayed());
    assert_ne!(bobs.body, carols.body);
    assert_eq!(db.effects().await, 4);
}

/// Missing, too long and unprintable keys are 400, a body over the limit 413; none runs.
async fn bad_requests_are_refused_before_running(db: Db) {
    let app = App::serve(&db, config().max_body_bytes(64).build().unwrap()).await;
    let body = json!({"amount": 1});
    app.post("/payments", None, &body).await.assert_problem(400);
    let long = "k".repeat(256);
    app.post("/payments", Some(&long), &body)
        .await
        .assert_problem(400);
    let request = app
        .client
        .post(format!("{}/payments", app.base))
        .header("content-type", "application/json")
        .header(
            "Idempotency-Key",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        )
        .body(body.to_string());
    common::Answer::read(request.send().await.unwrap())
        .await
        .unwrap()
        .assert_problem(400);
    let large = json!({"amount": 1, "note": "x".repeat(100)});
    app.post("/payments", Some("big"), &large)
        .await
        .assert_problem(413);
    assert_eq!(app.runs(), 0);
    assert_eq!(db.records().await, 0);
    let longest = "k".repeat(255);
    assert_eq!(
        app.post("/payments", Some(&longest), &body).await.status,
        201
    );
    assert_eq!(db.effects().await, 1);
}

/// With the key optional, a request without one passes through and runs every time; a
/// handler that takes an `IdempotentTx` then has none (500). Other methods pass through.
async fn an_optional_key_passes_through(db: Db) {
    let app = App::serve(&db, config().key_required(false).build().unwrap()).await;
    let first = app.post("/reject", None, &json!({})).await;
    let second = app.post("/reject", None, &json!({})).await;
    assert!(!first.replayed() && !second.replayed());
    assert_eq!(app.runs(), 2);
    app.post("/payments", None, &json!({"amount": 1}))
        .await
        .assert_problem(500);
    let get = app
        .client
        .get(format!("{}/reject", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 405);
    assert_eq!(db.records().await, 0);
    assert_eq!(db.effects().await, 0);
}

/// A 5xx rolls back the handler's row and releases the key: no row, no record; the retry
/// runs again, and its answer is stored.
async fn a_5xx_rolls_back_and_a_retry_runs(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    app.handlers.fail_next.store(true, Ordering::SeqCst);
    let failed = app.post("/flaky", Some("f"), &json!({})).await;
    assert_eq!(failed.status, 502);
    assert_eq!(db.effects().await, 0);
    assert_eq!(db.records().await, 0);
    let retried = app.post("/flaky", Some("f"), &json!({})).await;
    assert_eq!(retried.status, 201);
    assert!(!retried.replayed());
    assert_eq!(app.runs(), 2);
    let again = app.post("/flaky", Some("f"), &json!({})).await;
    assert!(again.replayed());
    assert_eq!(again.body, retried.body);
    assert_eq!(db.effects().await, 1);
}

/// A handler that ignores a failed statement and answers 201: on PostgreSQL the statement
/// aborted the transaction, so its effect cannot commit and the client must not be told
/// it succeeded: 500, nothing stored, the key released. SQLite undoes only the failed
/// statement: the effect commits with the stored answer.
async fn a_handler_that_ignores_a_failed_statement_is_not_answered_as_a_success(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    let answer = app.post("/ignores", Some("i"), &json!({})).await;
    if answer.status == 201 {
        assert_eq!((db.effects().await, db.records().await), (1, 1));
        return;
    }
    answer.assert_problem(500);
    let detail = answer.json()["detail"].to_string();
    assert!(
        detail.contains("aborted by an earlier error it ignored"),
        "{detail}"
    );
    assert_eq!((db.effects().await, db.records().await), (0, 0));
}

/// A panicking handler: 500, its row rolled back, the key released; the retry runs.
async fn a_panic_rolls_back_and_a_retry_runs(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    app.handlers.panic_next.store(true, Ordering::SeqCst);
    app.post("/panic", Some("p"), &json!({}))
        .await
        .assert_problem(500);
    assert_eq!(db.effects().await, 0);
    assert_eq!(db.records().await, 0);
    assert_eq!(app.post("/panic", Some("p"), &json!({})).await.status, 200);
    assert_eq!(db.effects().await, 1);
}

/// An answer that cannot be stored (over the limit) rolls back the row the handler wrote:
/// neither the effect nor the record exists.
async fn an_answer_not_stored_rolls_back_the_effect(db: Db) {
    let app = App::serve(&db, config().max_response_bytes(1000).build().unwrap()).await;
    app.post("/big", Some("b"), &json!({}))
        .await
        .assert_problem(500);
    assert_eq!(app.runs(), 1);
    assert_eq!(db.effects().await, 0);
    assert_eq!(db.records().await, 0);
}

/// Finding 6: the same key and body from another caller is that caller's own request. A
/// record one caller stored is never answered to another (neither replayed nor a 422 for
/// another body), and the store holds neither the caller's credential nor its name.
async fn another_caller_with_the_same_key_does_not_get_the_stored_answer(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    let body = r#"{"amount":7}"#;
    let as_caller = |credential| [("authorization", credential)];
    let alices = app
        .send("/payments", Some("k"), body.into(), &as_caller(ALICE))
        .await;
    assert_eq!(alices.status, 201, "{alices:?}");
    let bobs = app
        .send("/payments", Some("k"), body.into(), &as_caller(BOB))
        .await;
    assert_eq!(bobs.status, 201, "{bobs:?}");
    assert!(!bobs.replayed(), "bob got alice's answer: {bobs:?}");
    assert_ne!(bobs.body, alices.body);
    // Each caller's retry is its own stored answer.
    let alice_again = app
        .send("/payments", Some("k"), body.into(), &as_caller(ALICE))
        .await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alices.body);
    let bob_again = app
        .send("/payments", Some("k"), body.into(), &as_caller(BOB))
        .await;
    assert!(bob_again.replayed());
    assert_eq!(bob_again.body, bobs.body);
    // Another body under the key is not 422 for a third caller: it learns nothing of the
    // others' records.
    let carols = app
        .send(
            "/payments",
            Some("k"),
            r#"{"amount":8}"#.into(),
            &as_caller(CAROL),
        )
        .await;
    assert_eq!(carols.status, 201, "{carols:?}");
    assert_eq!(app.runs(), 3);
    assert_eq!(db.effects().await, 3);
    for scope in db.scopes().await {
        for secret in ["alice", "bob", "carol", "token"] {
            assert!(
                !scope.contains(secret),
                "the scope {scope:?} holds {secret:?}"
            );
        }
    }
}

/// A request the caller function names no caller for (no credential, or one it does not
/// know) is 401 and runs nothing; without a key, where the key is optional, it passes
/// through (there is no record to scope).
async fn a_request_without_a_caller_is_refused_before_running(db: Db) {
    let app = App::serve(&db, config().key_required(false).build().unwrap()).await;
    let body = json!({"amount": 1}).to_string();
    for credential in ["", "Basic YWxpY2U6cHc=", "Bearer token-"] {
        let answer = app
            .send(
                "/payments",
                Some("k"),
                body.clone(),
                &[("authorization", credential)],
            )
            .await;
        answer.assert_problem(401);
        assert!(!answer.body.windows(5).any(|w| w == b"token"), "{answer:?}");
    }
    assert_eq!(app.runs(), 0);
    assert_eq!(db.records().await, 0);
    let unkeyed = app
        .send("/reject", None, "{}".into(), &[("authorization", "")])
        .await;
    assert_eq!(unkeyed.status, 404);
    assert_eq!(app.runs(), 1);
}

/// The opt-out: with the layer shared across callers, a key's answer is every caller's.
async fn shared_across_callers_answers_any_caller_the_stored_answer(db: Db) {
    let app = App::serve_scoped(&db, config().build().unwrap(), Scoping::Shared).await;
    let body = r#"{"amount":3}"#;
    let alices = app
        .send(
            "/payments",
            Some("g"),
            body.into(),
            &[("authorization", ALICE)],
        )
        .await;
    assert_eq!(alices.status, 201);
    let anyones = app
        .send(
            "/payments",
            Some("g"),
            body.into(),
            &[("authorization", "")],
        )
        .await;
    assert!(anyones.replayed(), "{anyones:?}");
    assert_eq!(anyones.body, alices.body);
    assert_eq!(db.effects().await, 1);
}

/// Finding 7(b): 408, 409, 425 and 429 say "try again later", even with 4xx answers
/// stored: the answer is not stored, the handler's writes roll back and the key stays free,
/// so the client's retry runs the handler. Another 4xx is still stored.
async fn transient_client_errors_are_never_stored(db: Db) {
    let app = App::serve(&db, config().store_client_errors(true).build().unwrap()).await;
    for status in [408, 409, 425, 429] {
        let key = format!("busy-{status}");
        let body = json!({"status": status});
        let first = app.post("/busy", Some(&key), &body).await;
        let retry = app.post("/busy", Some(&key), &body).await;
        assert_eq!((first.status, retry.status), (status, status), "{retry:?}");
        assert!(!retry.replayed(), "{status} was stored: {retry:?}");
        assert_ne!(retry.body, first.body, "the retry of {status} did not run");
    }
    assert_eq!(app.runs(), 8);
    assert_eq!(db.effects().await, 0);
    assert_eq!(db.records().await, 0);
    let body = json!({"status": 404});
    let first = app.post("/busy", Some("busy-404"), &body).await;
    let again = app.post("/busy", Some("busy-404"), &body).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(db.effects().await, 1);
}

/// A 4xx is stored and replayed by default, and released when configured so.
async fn a_4xx_is_stored_unless_configured_not_to(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    let first = app.post("/reject", Some("r"), &json!({})).await;
    let again = app.post("/reject", Some("r"), &json!({})).await;
    assert_eq!((first.status, again.status), (404, 404));
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(app.runs(), 1);
    let app = App::serve(&db, config().store_client_errors(false).build().unwrap()).await;
    app.post("/reject", Some("r2"), &json!({})).await;
    let again = app.post("/reject", Some("r2"), &json!({})).await;
    assert!(!again.replayed());
    assert_eq!(app.runs(), 2);
}

/// A process killed mid-request (after its handler's write, before the commit) leaves no
/// effect and no claim: its transaction held the key and died with it, so the key's next
/// request runs at once, long before the lease (30 s here) could have run out, and once.
/// With Redis, the dead process's lease can only make that request wait (up to its 1 s
/// wait here) before the database lets it run.
async fn a_killed_request_frees_its_key_at_once(db: Db) {
    let config = || {
        config()
            .lease(Duration::from_secs(30))
            .wait(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let (doomed, server) = App::serve_killable(&db, config()).await;
    doomed.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 7});
    let request = doomed
        .client
        .post(format!("{}/payments", doomed.base))
        .header("Idempotency-Key", "l")
        .header("authorization", ALICE)
        .json(&body)
        .send();
    let in_flight = tokio::spawn(request);
    doomed.wait_held(1).await;
    server.kill();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the killed server answered"
    );
    assert_eq!(db.effects().await, 0);
    let app = App::serve(&db, config()).await;
    let retry = app.post("/payments", Some("l"), &body).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(app.runs(), 1);
    assert_eq!(db.effects().await, 1);
    let replay = app.post("/payments", Some("l"), &body).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

/// A client that hangs up while its request runs: the server drops the request, its
/// transaction rolls back (the handler's row with it) and frees the key, and the client's
/// retry with the key runs at once, not after the lease (30 s here), and once.
async fn a_client_that_hangs_up_frees_its_key_at_once(db: Db) {
    use tokio::io::AsyncWriteExt;
    let config = config()
        .lease(Duration::from_secs(30))
        .wait(Duration::from_secs(1))
        .build()
        .unwrap();
    let app = App::serve(&db, config).await;
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 8}).to_string();
    let address = app.base.trim_start_matches("http://");
    let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /payments HTTP/1.1\r\nhost: {address}\r\nidempotency-key: h\r\n\
         authorization: {ALICE}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    app.wait_held(1).await;
    drop(client);
    let retry = app
        .post("/payments", Some("h"), &json!({"amount": 8}))
        .await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(app.runs(), 2, "the hung-up run and the retry");
    assert_eq!(db.effects().await, 1, "the hung-up run's row rolled back");
    let replay = app
        .post("/payments", Some("h"), &json!({"amount": 8}))
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

/// A request holds its key for as long as it runs, however short the lease: a duplicate is
/// told 409 while it runs, in this process (it waits on the key held here) and, on
/// PostgreSQL, in another process (it waits on the claim's row in the running request's
/// open transaction, not on a lease that runs out); once it has completed, both get its
/// answer. One run, one effect.
async fn a_running_request_holds_its_key_however_long_it_runs(db: Db) {
    let config = || {
        config()
            .lease(Duration::from_millis(1))
            .wait(Duration::from_millis(200))
            .build()
            .unwrap()
    };
    let running = Arc::new(App::serve(&db, config()).await);
    let mut apps = vec![running.clone()];
    if matches!(db, Db::Pg { .. }) {
        apps.push(Arc::new(
            App::serve(&db.another_process().await, config()).await,
        ));
    }
    running.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 7});
    let first = tokio::spawn({
        let (app, body) = (running.clone(), body.clone());
        async move { app.post("/payments", Some("s"), &body).await }
    });
    running.wait_held(1).await;
    for app in &apps {
        for _ in 0..3 {
            let duplicate = app.post("/payments", Some("s"), &body).await;
            duplicate.assert_problem(409);
            assert!(duplicate.header("retry-after").is_some());
        }
    }
    running.open_gate();
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    for app in &apps {
        let replay = app.post("/payments", Some("s"), &body).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(apps.iter().map(|app| app.runs()).sum::<u32>(), 1);
    assert_eq!(db.effects().await, 1);
}

common::on_both!(
    concurrent_requests_with_one_key_run_once,
    a_request_in_progress_is_waited_for,
    the_key_is_bound_to_its_request_route_and_caller,
    bad_requests_are_refused_before_running,
    an_optional_key_passes_through,
    a_5xx_rolls_back_and_a_retry_runs,
    a_handler_that_ignores_a_failed_statement_is_not_answered_as_a_success,
    a_panic_rolls_back_and_a_retry_runs,
    an_answer_not_stored_rolls_back_the_effect,
    a_4xx_is_stored_unless_configured_not_to,
    another_caller_with_the_same_key_does_not_get_the_stored_answer,
    a_request_without_a_caller_is_refused_before_running,
    shared_across_callers_answers_any_caller_the_stored_answer,
    transient_client_errors_are_never_stored,
    a_killed_request_frees_its_key_at_once,
    a_client_that_hangs_up_frees_its_key_at_once,
    a_running_request_holds_its_key_however_long_it_runs,
);
