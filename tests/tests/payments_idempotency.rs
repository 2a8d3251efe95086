//! The payments example's `Idempotency-Key` layer, as a real process called over HTTP, on
//! PostgreSQL alone (`postgres`) and with the Redis fast path in front of it
//! (`postgres_redis`, `REDIS_URL`):
//!
//! - 100 concurrent requests with one key, the provider slow, charge once; every other answer is the first one,
//!   byte for byte and marked replayed, or a 409;
//! - the same key with another body is 422 and charges nothing;
//! - the same key and body from another account charges that account's order on its own,
//!   and a request without a known API key is 401 and charges nothing;
//! - a 5xx (the provider down, `PAYMENTS_PROVIDER_OUTAGE`) releases the key: the retry runs
//!   the charge again;
//! - after its TTL (`IDEMPOTENCY_TTL_MS`) a key runs again, and the example purges the
//!   expired record;
//! - a setting that does not parse, or that the layer refuses, stops the process naming it.

use std::sync::Mutex;

use consumer_tests::common::{redis_url, wait_until};
use consumer_tests::payments::{Answer, Payments, Server, Store, OTHER_API_KEY};

/// How many answers Redis caches for the test's schema (each key holds the store's table,
/// qualified by the schema). On the database alone: none.
async fn cached_in_redis(payments: &Payments) -> usize {
    let client = redis::Client::open(redis_url()).expect("REDIS_URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("consumer-http:answer:*\"{}\"*", payments.schema()))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    keys.len()
}

/// The fast path is in front exactly when the test asked for it: `n` answers cached, or none.
async fn assert_cached(payments: &Payments, n: usize) {
    let expected = match payments.store() {
        Store::Postgres => 0,
        Store::PostgresRedis => n,
    };
    assert_eq!(
        cached_in_redis(payments).await,
        expected,
        "answers in Redis"
    );
}

/// Pays `order` with `key` at `server`; the answer.
async fn pay(payments: &Payments, server: &Server, key: &str, order: i64) -> Answer {
    payments
        .pay(&server.base, key, order)
        .await
        .unwrap_or_else(|e| panic!("{key}: no answer: {e}"))
}

/// `answer` is a charge that ran now: 201, not replayed.
fn assert_charged(answer: &Answer) {
    assert_eq!(
        (answer.status, answer.replayed()),
        (201, false),
        "{answer:?}"
    );
}

/// `answer` replays `first`: `Idempotent-Replayed: true`, and the same status, body (byte
/// for byte) and content type.
fn assert_replay(answer: &Answer, first: &Answer) {
    assert!(answer.replayed(), "{answer:?}");
    assert_eq!(answer.status, first.status, "{answer:?}");
    assert_eq!(answer.body, first.body, "byte-identical");
    assert_eq!(answer.header("content-type"), first.header("content-type"));
}

/// How many records the layer's store holds for `key`.
async fn records(payments: &Payments, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM http_idempotency WHERE key = $1")
        .bind(key)
        .fetch_one(payments.pool())
        .await
        .expect("count records")
}

/// 100 concurrent requests with one key, the provider taking 300 ms per charge so that the
/// others arrive while the first runs: exactly one charge; one answer is the charge's (201,
/// not replayed), and each of the other 99 is a replay of it (same status, body and content
/// type, `Idempotent-Replayed: true`) or a 409 problem.
async fn a_hundred_concurrent_requests_with_one_key_charge_once(store: Store) {
    let payments = Payments::on(store).await;
    let server = payments
        .start(&[("PAYMENTS_PROVIDER_LATENCY_MS", "300")], "concurrent")
        .await;
    let answers: Vec<Answer> = futures::future::join_all(
        (0..100).map(|_| payments.pay(&server.base, "pay-concurrent", 31)),
    )
    .await
    .into_iter()
    .map(|a| a.expect("an answer"))
    .collect();
    assert_eq!(payments.charges(31).await, 1, "one key, one charge");
    let first: Vec<&Answer> = answers.iter().filter(|a| !a.replayed()).collect();
    let first = match first.as_slice() {
        [only] => *only,
        _ => panic!("not exactly one answer ran: {answers:#?}"),
    };
    assert_eq!(first.status, 201, "{first:?}");
    let (mut replays, mut conflicts) = (0, 0);
    for a in &answers {
        match a.status {
            _ if std::ptr::eq(a, first) => {}
            409 => {
                conflicts += 1;
                a.assert_problem(409);
                assert!(a.header("retry-after").is_some(), "{a:?}");
            }
            _ => {
                replays += 1;
                assert_replay(a, first);
            }
        }
    }
    assert_eq!(replays + conflicts, 99);
    eprintln!("{replays} replays, {conflicts} conflicts");
    let again = pay(&payments, &server, "pay-concurrent", 31).await;
    assert_replay(&again, first);
    assert_eq!(payments.charges(31).await, 1);
    assert_cached(&payments, 1).await;
}

/// The same key with another body: 422 problem+json, before and after the first answer was
/// replayed; the other order is never charged, the first stays charged once.
async fn the_same_key_with_another_body_is_422_and_charges_nothing(store: Store) {
    let payments = Payments::on(store).await;
    let server = payments.start(&[], "mismatch").await;
    let first = pay(&payments, &server, "pay-mismatch", 41).await;
    assert_charged(&first);
    for _ in 0..2 {
        let other = pay(&payments, &server, "pay-mismatch", 42).await;
        other.assert_problem(422);
        assert!(!other.replayed(), "{other:?}");
        let replay = pay(&payments, &server, "pay-mismatch", 41).await;
        assert_replay(&replay, &first);
    }
    assert_eq!(
        payments.charges(42).await,
        0,
        "the other body charged nothing"
    );
    assert_eq!(payments.charges(41).await, 1);
    assert_cached(&payments, 1).await;
}

/// The provider is down for the first charge (`PAYMENTS_PROVIDER_OUTAGE=1`): 502, the charge
/// rolled back, and the key released (no record, nothing cached). The client's retry with
/// the key runs the handler again: a fresh 201 that charges once, then replayed.
async fn a_5xx_releases_the_key_and_the_retry_runs_again(store: Store) {
    let payments = Payments::on(store).await;
    let server = payments
        .start(&[("PAYMENTS_PROVIDER_OUTAGE", "1")], "outage")
        .await;
    let failed = pay(&payments, &server, "pay-outage", 51).await;
    assert_eq!(failed.status, 502, "{failed:?}");
    assert!(!failed.replayed(), "{failed:?}");
    assert_eq!(payments.charges(51).await, 0, "rolled back");
    assert_eq!(
        records(&payments, "pay-outage").await,
        0,
        "the key released"
    );
    assert_cached(&payments, 0).await;

    let retried = pay(&payments, &server, "pay-outage", 51).await;
    assert_charged(&retried);
    assert_eq!(payments.charges(51).await, 1);
    assert!(
        server
            .process
            .log()
            .contains("the payment provider is down"),
        "the outage was the provider's"
    );
    let again = pay(&payments, &server, "pay-outage", 51).await;
    assert_replay(&again, &retried);
    assert_eq!(payments.charges(51).await, 1);
    assert_cached(&payments, 1).await;
}

/// With `IDEMPOTENCY_TTL_MS=2000` a completed key is replayed until its TTL, then runs
/// again (a new charge, a new answer), and the layer's purge deletes an expired record.
/// Waiting past the TTL is a poll of the answer, with a deadline.
async fn after_its_ttl_a_key_runs_again_and_its_record_is_purged(store: Store) {
    let payments = Payments::on(store).await;
    let server = payments
        .start(&[("IDEMPOTENCY_TTL_MS", "2000")], "ttl")
        .await;
    let first = pay(&payments, &server, "pay-ttl", 61).await;
    assert_charged(&first);
    // A key never sent again: only the purge can remove its record.
    let left = pay(&payments, &server, "pay-left", 62).await;
    assert_eq!(left.status, 201, "{left:?}");
    let replay = pay(&payments, &server, "pay-ttl", 61).await;
    assert_replay(&replay, &first);

    let rerun = Mutex::new(None);
    wait_until("the key to run again after its TTL", || async {
        let a = pay(&payments, &server, "pay-ttl", 61).await;
        if a.replayed() {
            assert_replay(&a, &first);
            return false;
        }
        *rerun.lock().expect("not poisoned") = Some(a);
        true
    })
    .await;
    let rerun = rerun
        .into_inner()
        .expect("not poisoned")
        .expect("the rerun's answer");
    assert_eq!(rerun.status, 201, "{rerun:?}");
    assert_ne!(rerun.body, first.body, "a new charge, a new answer");
    assert_eq!(payments.charges(61).await, 2);

    // The layer's purge logs after its delete committed: wait for both.
    wait_until("the layer to purge the expired record", || async {
        let logged = server
            .process
            .log()
            .contains("purged expired idempotency records");
        logged && records(&payments, "pay-left").await == 0
    })
    .await;
    assert_eq!(payments.charges(62).await, 1, "purging charges nothing");
}

/// Finding 6 through the example: another account (its own API key) sending the first
/// account's key and body is charged on its own, and never gets the first account's answer;
/// each account's retry replays its own answer. No API key, or an unknown one: 401, nothing
/// charged.
async fn another_account_with_the_same_key_is_charged_on_its_own(store: Store) {
    let payments = Payments::on(store).await;
    let server = payments.start(&[], "accounts").await;
    let first = pay(&payments, &server, "pay-shared-key", 51).await;
    assert_charged(&first);
    let other_account = format!("Bearer {OTHER_API_KEY}");
    let pay_as_other = || payments.pay_as(&other_account, &server.base, "pay-shared-key", 51);
    let others = pay_as_other().await.expect("an answer");
    assert_charged(&others);
    assert_ne!(
        others.body, first.body,
        "the other account got the first one's answer"
    );
    assert_replay(&pay_as_other().await.expect("an answer"), &others);
    assert_replay(&pay(&payments, &server, "pay-shared-key", 51).await, &first);
    assert_eq!(payments.charges(51).await, 2, "one charge per account");
    assert_eq!(records(&payments, "pay-shared-key").await, 2);
    for credential in ["", "Bearer sk_unknown"] {
        let refused = payments
            .pay_as(credential, &server.base, "pay-shared-key", 52)
            .await
            .expect("an answer");
        assert_eq!(refused.status, 401, "{refused:?}");
    }
    assert_eq!(payments.charges(52).await, 0);
}

/// A setting that does not parse, a TTL shorter than the lease, a negative outage, a URL
/// that is not Redis's and an API key entry without its account each stop the process
/// before it listens, naming the variable (and never showing the URL's password or the API
/// key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_setting_stops_the_example_naming_it() {
    let payments = Payments::new().await;
    let cases: [(&'static str, &str, &str); 6] = [
        ("IDEMPOTENCY_TTL_MS", "soon", "expected whole milliseconds"),
        ("IDEMPOTENCY_TTL_MS", "500", "shorter than the lease"),
        ("IDEMPOTENCY_LEASE_MS", "0", "lease"),
        ("PAYMENTS_PROVIDER_OUTAGE", "-1", "a number of charges"),
        ("REDIS_URL", "http://user:s3cret@127.0.0.1:1", "redis.url"),
        (
            "PAYMENTS_API_KEYS",
            "sk_s3cret",
            "entry 1 is not `key=account`",
        ),
    ];
    for (i, (name, value, why)) in cases.into_iter().enumerate() {
        let process = payments.spawn(&[(name, value)], &format!("bad-{i}"));
        let (status, log) = process.exit().await;
        assert!(!status.success(), "{name}={value} was accepted\n{log}");
        assert!(
            log.contains(name) && log.contains(why),
            "{name}={value}:\n{log}"
        );
        assert!(!log.contains("listening on"), "{log}");
        assert!(!log.contains("s3cret"), "{log}");
    }
}

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use consumer_tests::payments::Store;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name(Store::Postgres).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres_redis() {
                    super::$name(Store::PostgresRedis).await
                }
            }
        )*
    };
}

on_both_stores!(
    a_hundred_concurrent_requests_with_one_key_charge_once,
    the_same_key_with_another_body_is_422_and_charges_nothing,
    another_account_with_the_same_key_is_charged_on_its_own,
    a_5xx_releases_the_key_and_the_retry_runs_again,
    after_its_ttl_a_key_runs_again_and_its_record_is_purged,
);
