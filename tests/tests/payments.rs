//! The payments example as a real process on PostgreSQL, called over HTTP:
//!
//! - killed right after charging an order (SIGABRT, before its transaction commits and
//!   before it answers), then restarted, the client's retry with the same `Idempotency-Key`
//!   charges once, because the charge and the stored answer are one transaction; the
//!   retry's answer is replayed byte for byte after that, and 50 concurrent requests with one
//!   key charge once;
//! - a long operation (`POST /refunds`) answers 202 with an operation id, a retry gets the
//!   same 202 and id and starts nothing, the status route tells its account when it is
//!   done, and the refund is made once;
//! - retrying clients under load while the server is killed and restarted on a schedule:
//!   no charge lost, none doubled (the load profile of the issue, short enough for CI).

use std::time::Duration;

use consumer_tests::common::{wait_until, DEADLINE};
use consumer_tests::payments::Payments;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_after_the_charge_charges_once_on_the_clients_retry() {
    let payments = Payments::new().await;
    let dying = payments
        .start(&[("PAYMENTS_ABORT_AFTER_CHARGE", "7")], "dying")
        .await;
    assert!(
        payments.pay(&dying.base, "pay-7", 7).await.is_err(),
        "the process died before answering"
    );
    let (status, log) = dying.process.exit().await;
    assert!(!status.success(), "aborted: {status}\n{log}");
    assert!(log.contains("aborting after the charge"), "{log}");
    assert_eq!(
        payments.charges(7).await,
        0,
        "the charge rolled back with the answer"
    );

    let running = payments.start(&[], "restarted").await;
    let base = &running.base;
    // The dead request's transaction held its key, and died with the process: the first
    // retry charges.
    let first = payments.pay(base, "pay-7", 7).await.expect("an answer");
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    let first = first.body;
    assert_eq!(payments.charges(7).await, 1);
    let replay = payments.pay(base, "pay-7", 7).await.expect("a replay");
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(replay.body, first, "byte-identical");
    assert_eq!(payments.charges(7).await, 1);

    let answers = futures::future::join_all((0..50).map(|_| payments.pay(base, "pay-8", 8))).await;
    for a in &answers {
        let status = a.as_ref().expect("an answer").status;
        assert!(matches!(status, 201 | 409), "{a:?}");
    }
    wait_until("pay-8 is charged", || async {
        payments
            .pay(base, "pay-8", 8)
            .await
            .expect("an answer")
            .status
            == 201
    })
    .await;
    assert_eq!(
        payments.charges(8).await,
        1,
        "50 requests with one key charge once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_operation_answers_202_once_and_its_status_endpoint_tells_how_it_went() {
    let payments = Payments::new().await;
    let running = payments.start(&[], "refunds").await;
    let (base, client) = (&running.base, payments.client());
    let refund = || {
        client
            .post(format!("{base}/refunds"))
            .header("Idempotency-Key", "refund-3")
            .json(&json!({"order_id": 3, "amount": 40}))
            .send()
    };
    let first = refund().await.expect("an answer");
    assert_eq!(first.status().as_u16(), 202);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let body: serde_json::Value = first.json().await.unwrap();
    let id = body["operation_id"]
        .as_str()
        .expect("an operation id")
        .to_owned();
    assert_eq!(location, format!("/operations/{id}"));

    let again = refund().await.expect("an answer");
    assert_eq!(again.status().as_u16(), 202);
    assert!(again.headers().contains_key("idempotent-replayed"));
    assert_eq!(again.headers()["location"].to_str().unwrap(), location);
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(
        again["operation_id"].as_str(),
        Some(id.as_str()),
        "the same operation"
    );

    wait_until("the operation succeeds", || async {
        let status: serde_json::Value = client
            .get(format!("{base}{location}"))
            .send()
            .await
            .expect("the status endpoint")
            .json()
            .await
            .expect("JSON");
        status["status"] == "succeeded"
    })
    .await;
    assert_eq!(
        payments.count("http_idempotency_operations").await,
        1,
        "the retry started nothing"
    );
    assert_eq!(payments.count("refunds").await, 1, "refunded once");
    let other_account = client
        .get(format!("{base}{location}"))
        .bearer_auth(consumer_tests::payments::OTHER_API_KEY)
        .send()
        .await
        .expect("the status endpoint");
    assert_eq!(
        other_account.status().as_u16(),
        404,
        "another account does not see it"
    );
}

/// A retrying client's load while the server is killed (SIGKILL) and restarted four times,
/// at fifths of the load: every payment is charged exactly once. 8 clients pay 25 orders each, one key per order,
/// and retry each until it is answered 201 (a refused connection, a reset, a 409 while a dead
/// request's claim holds the key, or a 503 are retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrying_client_loses_and_doubles_no_charge_while_the_server_is_killed_and_restarted() {
    const CLIENTS: i64 = 8;
    const PER_CLIENT: i64 = 25;
    const KILLS: usize = 4;
    let payments = Payments::new().await;
    let first = payments.start(&[], "load-0").await;
    let base = std::sync::Arc::new(tokio::sync::RwLock::new(first.base.clone()));
    let retries = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));

    // Paid orders so far: the killer strikes at set points of the load, so every kill lands
    // while the clients are paying, however fast the machine is.
    let paid = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let killer = {
        let (base, paid, payments) = (base.clone(), paid.clone(), payments.clone());
        tokio::spawn(async move {
            let mut running = first;
            let step = (CLIENTS * PER_CLIENT) as u64 / (KILLS as u64 + 1);
            for n in 1..=KILLS {
                let at = step * n as u64;
                wait_until("the load reaches the next kill", || {
                    std::future::ready(paid.load(std::sync::atomic::Ordering::SeqCst) >= at)
                })
                .await;
                drop(running); // SIGKILL, whatever is in flight
                running = payments.start(&[], &format!("load-{n}")).await;
                *base.write().await = running.base.clone();
            }
            (running, KILLS)
        })
    };

    let client = payments.client();
    let deadline = tokio::time::Instant::now() + DEADLINE * 2;
    let payers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (client, base, retries) = (client.clone(), base.clone(), retries.clone());
            let paid = paid.clone();
            tokio::spawn(async move {
                for i in 0..PER_CLIENT {
                    let order = 1000 + c * PER_CLIENT + i;
                    loop {
                        let url = format!("{}/payments", base.read().await);
                        let answer = client
                            .post(url)
                            .header("Idempotency-Key", format!("load-{order}"))
                            .json(&json!({"order_id": order, "amount": 10}))
                            .send()
                            .await;
                        match answer.map(|a| a.status().as_u16()) {
                            Ok(201) => {
                                paid.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                break;
                            }
                            Ok(409 | 503) | Err(_) => {
                                retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                assert!(
                                    tokio::time::Instant::now() < deadline,
                                    "order {order} was never answered 201"
                                );
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Ok(other) => panic!("order {order}: unexpected status {other}"),
                        }
                    }
                }
            })
        })
        .collect();
    for p in payers {
        p.await.expect("a client");
    }
    let (last, restarts) = killer.await.expect("the killer");
    drop(last);
    let retries = retries.load(std::sync::atomic::Ordering::Relaxed);
    assert!(retries > 0, "the kills hit requests in flight");
    eprintln!("{restarts} kills, {retries} retried requests");

    let per_order: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT order_id, count(*) FROM charges GROUP BY order_id ORDER BY order_id",
    )
    .fetch_all(payments.pool())
    .await
    .expect("charges per order");
    let doubled: Vec<_> = per_order.iter().filter(|(_, n)| *n != 1).collect();
    assert!(doubled.is_empty(), "charged more than once: {doubled:?}");
    assert_eq!(
        per_order.len() as i64,
        CLIENTS * PER_CLIENT,
        "every order charged (none lost)"
    );
}

/// Started with a `DB_SCHEMA` that does not exist yet, the example creates it with its
/// tables (as the invoices example does) and takes payments in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_creates_the_schema_it_is_given() {
    let payments = Payments::new().await;
    let own = format!("{}_own", payments.schema());
    let server = payments.start(&[("DB_SCHEMA", &own)], "own-schema").await;
    let paid = payments.pay(&server.base, "own-1", 7).await.expect("pay");
    assert_eq!(paid.status, 201, "{paid:?}");
    let charges: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{own}\".charges WHERE order_id = 7"
    ))
    .fetch_one(payments.pool())
    .await
    .expect("count the charges in the example's own schema");
    assert_eq!(charges, 1);
}
