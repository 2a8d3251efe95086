//! The payments example as a real process on PostgreSQL, called over HTTP:
//!
//! - killed right after charging an order (SIGABRT, before its transaction commits and
//!   before it answers), then restarted, the client's retry with the same `Idempotency-Key`
//!   charges once, because the charge and the stored answer are one transaction; the
//!   retry's answer is replayed byte for byte after that, and 50 concurrent requests with one
//!   key charge once;
//! - a long operation (`POST /refunds`) answers 202 with an operation id, a retry gets the
//!   same 202 and id and starts nothing, and the status endpoint tells when it is done;
//! - retrying clients under load while the server is killed and restarted on a schedule:
//!   no charge lost, none doubled (the load profile of the issue, short enough for CI).

use std::collections::HashMap;
use std::time::Duration;

use consumer_tests::common::{database_url, wait_until, PgEnv, DEADLINE};
use consumer_tests::process::{package_binary, Process};
use serde_json::json;

/// Starts the example with `extra` settings and waits for the address it listens on.
async fn start(env: &PgEnv, extra: &[(&'static str, &str)], log: &str) -> (Process, String) {
    let mut vars: HashMap<&'static str, String> = HashMap::from([
        ("DATABASE_URL", database_url()),
        ("DB_SCHEMA", env.schema.clone()),
        ("PAYMENTS_ADDR", "127.0.0.1:0".to_owned()),
        ("IDEMPOTENCY_LEASE_MS", "1000".to_owned()),
    ]);
    for (k, v) in extra {
        vars.insert(k, (*v).to_owned());
    }
    let log = std::env::temp_dir().join(format!("{}-{log}.log", env.schema));
    let process = Process::spawn_binary(package_binary("payments", "payments"), &vars, log);
    let mut addr = String::new();
    wait_until("the example listens", || {
        let log = process.log();
        addr = log
            .lines()
            .find_map(|l| l.split("listening on ").nth(1))
            .map(|a| a.trim().to_owned())
            .unwrap_or_default();
        std::future::ready(!addr.is_empty())
    })
    .await;
    (process, format!("http://{addr}"))
}

async fn charges(env: &PgEnv, order: i64) -> i64 {
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("connect");
    let n = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".charges WHERE order_id = $1",
        env.schema
    ))
    .bind(order)
    .fetch_one(&pool)
    .await
    .expect("count charges");
    pool.close().await;
    n
}

async fn pay(base: &str, key: &str, order: i64) -> reqwest::Result<(u16, String, bool)> {
    let answer = reqwest::Client::new()
        .post(format!("{base}/payments"))
        .header("Idempotency-Key", key)
        .json(&json!({"order_id": order, "amount": 100}))
        .send()
        .await?;
    let status = answer.status().as_u16();
    let replayed = answer.headers().contains_key("idempotent-replayed");
    Ok((status, answer.text().await?, replayed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_after_the_charge_charges_once_on_the_clients_retry() {
    let env = PgEnv::new().await;
    let (dying, base) = start(&env, &[("PAYMENTS_ABORT_AFTER_CHARGE", "7")], "dying").await;
    assert!(
        pay(&base, "pay-7", 7).await.is_err(),
        "the process died before answering"
    );
    let (status, log) = dying.exit().await;
    assert!(!status.success(), "aborted: {status}\n{log}");
    assert!(log.contains("aborting after the charge"), "{log}");
    assert_eq!(
        charges(&env, 7).await,
        0,
        "the charge rolled back with the answer"
    );

    let (_running, base) = start(&env, &[], "restarted").await;
    // The dead request's claim holds the key until its lease (1 s) runs out: until then the
    // retry is told 409, as a client would be.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let first = loop {
        match pay(&base, "pay-7", 7).await {
            Ok((201, body, false)) => break body,
            Ok((409, _, _)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("unexpected answer {other:?}"),
        }
    };
    assert_eq!(charges(&env, 7).await, 1);
    let (status, body, replayed) = pay(&base, "pay-7", 7).await.expect("a replay");
    assert_eq!((status, replayed), (201, true));
    assert_eq!(body, first, "byte-identical");
    assert_eq!(charges(&env, 7).await, 1);

    let answers = futures::future::join_all((0..50).map(|_| pay(&base, "pay-8", 8))).await;
    for a in &answers {
        let (status, _, _) = a.as_ref().expect("an answer");
        assert!(matches!(status, 201 | 409), "{a:?}");
    }
    wait_until("pay-8 is charged", || async {
        pay(&base, "pay-8", 8).await.expect("an answer").0 == 201
    })
    .await;
    assert_eq!(
        charges(&env, 8).await,
        1,
        "50 requests with one key charge once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_operation_answers_202_once_and_its_status_endpoint_tells_how_it_went() {
    let env = PgEnv::new().await;
    let (_running, base) = start(&env, &[], "refunds").await;
    let client = reqwest::Client::new();
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
    let id = body["operation_id"].as_i64().expect("an operation id");
    assert_eq!(location, format!("/operations/{id}"));

    let again = refund().await.expect("an answer");
    assert_eq!(again.status().as_u16(), 202);
    assert!(again.headers().contains_key("idempotent-replayed"));
    assert_eq!(again.headers()["location"].to_str().unwrap(), location);
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(
        again["operation_id"].as_i64(),
        Some(id),
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
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("connect");
    let operations: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".operations",
        env.schema
    ))
    .fetch_one(&pool)
    .await
    .expect("count operations");
    assert_eq!(operations, 1, "the retry started nothing");
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
    let env = PgEnv::new().await;
    let (first, base) = start(&env, &[], "load-0").await;
    let base = std::sync::Arc::new(tokio::sync::RwLock::new(base));
    let retries = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));

    // Paid orders so far: the killer strikes at set points of the load, so every kill lands
    // while the clients are paying, however fast the machine is.
    let paid = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let killer = {
        let (base, paid) = (base.clone(), paid.clone());
        let env_schema = env.schema.clone();
        tokio::spawn(async move {
            let env = PgEnv { schema: env_schema };
            let mut running = first;
            let step = (CLIENTS * PER_CLIENT) as u64 / (KILLS as u64 + 1);
            for n in 1..=KILLS {
                let at = step * n as u64;
                wait_until("the load reaches the next kill", || {
                    std::future::ready(paid.load(std::sync::atomic::Ordering::SeqCst) >= at)
                })
                .await;
                drop(running); // SIGKILL, whatever is in flight
                let (next, addr) = start(&env, &[], &format!("load-{n}")).await;
                *base.write().await = addr;
                running = next;
            }
            (running, KILLS)
        })
    };

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
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

    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .expect("connect");
    let per_order: Vec<(i64, i64)> = sqlx::query_as(&format!(
        "SELECT order_id, count(*) FROM \"{}\".charges GROUP BY order_id ORDER BY order_id",
        env.schema
    ))
    .fetch_all(&pool)
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
