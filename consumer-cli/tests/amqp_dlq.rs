//! The `consumer` command against real RabbitMQ and PostgreSQL: a worker dead-letters five
//! messages for two reasons; `dlq list` groups them without consuming them; once the cause
//! is fixed, `dlq replay --reason` runs those messages once and their keys end completed,
//! the others stay; a second replay runs nothing; a bad URL fails naming the setting
//! without showing its password.

use std::sync::atomic::Ordering;
use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_tests::amqp::{self, wait_for, Rabbit};
use consumer_tests::common::PgEnv;
use serde_json::json;
use sqlx::Postgres;
use support::{consumer, json_of, wait_completed, FiveDeadLetters, FIXED, HANDLER};

mod support;

const WAIT: Duration = Duration::from_secs(60);

async fn ledger(pg: &PgEnv, inbox: &consumer_core::Inbox<Postgres>, id: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM \"{}\".ledger WHERE job_id = $1",
        pg.schema
    );
    sqlx::query_scalar(&sql)
        .bind(id)
        .fetch_one(inbox.pool())
        .await
        .expect("count the ledger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_are_grouped_replayed_once_and_the_rest_stay() {
    let FiveDeadLetters {
        pg,
        cfg,
        dlq,
        inbox,
        running,
        publisher,
        rejected,
        flaky,
    } = FiveDeadLetters::new("cli").await;

    let env = [
        ("DB_SCHEMA", pg.schema.as_str()),
        ("DLQ_QUEUE", dlq.as_str()),
        ("AMQP_ORIGIN_SECRET", amqp::ORIGIN_SECRET),
    ];
    let list = json_of(&["dlq", "list", "--broker", "amqp"], &env).await;
    assert_eq!(list["total"], 5, "{list}");
    let groups = list["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 2, "{list}");
    let group = |reason: &str| {
        groups
            .iter()
            .find(|g| g["reason"] == reason)
            .unwrap_or_else(|| panic!("no group {reason}: {list}"))
            .clone()
    };
    let permanent = group("permanent_error");
    assert_eq!(permanent["count"], 3, "{list}");
    assert_eq!(permanent["fingerprint"], "order # rejected by the provider");
    assert_eq!(permanent["handlers"], json!([HANDLER]));
    assert_eq!(group("max_attempts_exceeded")["count"], 2, "{list}");
    // Listing consumed nothing.
    wait_for("the DLQ still holds 5", WAIT, || async {
        Rabbit::ready(&dlq).await == 5
    })
    .await;

    let show = json_of(&["dlq", "show", "--broker", "amqp", &rejected[0]], &env).await;
    assert_eq!(
        show[0]["headers"]["x-dead-letter-reason"],
        "permanent_error"
    );
    assert!(
        show[0]["payload"].as_str().unwrap().contains(&rejected[0]),
        "{show}"
    );

    let replay = [
        "dlq",
        "replay",
        "--broker",
        "amqp",
        "--reason",
        "permanent_error",
    ];
    let mut dry = replay.to_vec();
    dry.push("--dry-run");
    let dry = json_of(&dry, &env).await;
    assert_eq!(
        (dry["selected"].clone(), dry["replayed"].clone()),
        (json!(3), json!(0))
    );
    for id in &rejected {
        let e = inbox.entry(HANDLER, id).await.unwrap().expect("a row");
        assert_eq!(e.status, EntryStatus::Dead, "a dry run releases nothing");
    }

    // Fix the cause, then replay.
    FIXED.store(true, Ordering::SeqCst);
    let done = json_of(&replay, &env).await;
    assert_eq!(done["replayed"], 3, "{done}");
    assert_eq!(done["failed"], 0, "{done}");
    for line in done["messages"].as_array().unwrap() {
        assert_eq!(line["key_released"], true, "{done}");
    }
    wait_completed(&inbox, HANDLER, &rejected, WAIT).await;
    for id in &rejected {
        assert_eq!(ledger(&pg, &inbox, id).await, 1, "{id} ran once");
    }
    for id in &flaky {
        assert_eq!(ledger(&pg, &inbox, id).await, 0, "{id} did not run");
        let e = inbox.entry(HANDLER, id).await.unwrap().expect("a row");
        assert_eq!(e.status, EntryStatus::Dead, "{id} stays dead");
    }
    wait_for("the DLQ keeps the other 2", WAIT, || async {
        Rabbit::ready(&dlq).await == 2
    })
    .await;
    let list = json_of(&["dlq", "list", "--broker", "amqp"], &env).await;
    assert_eq!(list["total"], 2, "{list}");
    assert_eq!(
        list["groups"][0]["reason"], "max_attempts_exceeded",
        "{list}"
    );

    // The text forms, for people.
    let text = consumer(&["dlq", "list", "--broker", "amqp"], &env).await;
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("2 dead letters in 1 group\n"), "{text}");
    let text = consumer(&["inbox", "stats"], &env).await;
    assert!(String::from_utf8_lossy(&text.stdout).contains(HANDLER));

    // The same replay again, and by id: nothing left to replay.
    let again = json_of(&replay, &env).await;
    assert_eq!(
        (again["selected"].clone(), again["replayed"].clone()),
        (json!(0), json!(0))
    );
    let by_id = json_of(&["dlq", "replay", "--broker", "amqp", &rejected[0]], &env).await;
    assert_eq!(by_id["selected"], 0, "{by_id}");
    // A replay republished twice (the CLI died before its ack) is a duplicate in the inbox.
    let before = running.worker.snapshot().duplicates;
    publisher
        .publish_json(
            &cfg.queue,
            &rejected[0],
            &json!({"id": rejected[0], "kind": "rejected"}),
        )
        .await
        .unwrap();
    wait_for("the second copy is a duplicate", WAIT, || async {
        running.worker.snapshot().duplicates > before
    })
    .await;
    for id in &rejected {
        assert_eq!(ledger(&pg, &inbox, id).await, 1, "{id} ran once");
    }

    let stats = json_of(&["inbox", "stats", "--handler", HANDLER], &env).await;
    assert_eq!(stats["handlers"][0]["completed"], 3, "{stats}");
    assert_eq!(stats["handlers"][0]["dead"], 2, "{stats}");
    let all = json_of(&["inbox", "stats"], &env).await;
    assert_eq!(all["handlers"].as_array().unwrap().len(), 1, "{all}");

    // The inbox commands on the keys left dead.
    let show = json_of(&["inbox", "show", HANDLER, &flaky[0]], &env).await;
    assert_eq!(show["status"], "dead", "{show}");
    assert!(
        show["last_error"].as_str().unwrap().contains("timed out"),
        "{show}"
    );
    let released = json_of(&["inbox", "release", HANDLER, &flaky[0]], &env).await;
    assert_eq!(released["released"], true, "{released}");
    assert_eq!(inbox.entry(HANDLER, &flaky[0]).await.unwrap(), None);
    let again = json_of(&["inbox", "release", HANDLER, &rejected[0]], &env).await;
    assert_eq!(again["released"], false, "a completed key stays: {again}");
    let young = ["inbox", "purge", "--status", "dead", "--older-than", "30d"];
    assert_eq!(json_of(&young, &env).await["rows"], 0);
    let dry = [
        "inbox",
        "purge",
        "--status",
        "dead",
        "--older-than",
        "0s",
        "--dry-run",
    ];
    assert_eq!(json_of(&dry, &env).await["rows"], 1);
    assert!(inbox.entry(HANDLER, &flaky[1]).await.unwrap().is_some());
    let purge = ["inbox", "purge", "--status", "dead", "--older-than", "0s"];
    assert_eq!(json_of(&purge, &env).await["rows"], 1);
    assert_eq!(inbox.entry(HANDLER, &flaky[1]).await.unwrap(), None);
    let stats = json_of(&["inbox", "stats"], &env).await;
    assert_eq!(stats["handlers"][0]["completed"], 3, "{stats}");
    assert_eq!(stats["handlers"][0]["dead"], 0, "{stats}");

    // Purge what nobody will replay.
    let purged = json_of(&["dlq", "purge", "--broker", "amqp", "--all"], &env).await;
    assert_eq!(purged["purged"], 2, "{purged}");
    wait_for("the DLQ is empty", WAIT, || async {
        Rabbit::ready(&dlq).await == 0
    })
    .await;
    publisher.close().await;
    running.stop().await;
    Rabbit::delete_topology(&cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_the_inbox_in_the_schema() {
    let schema = amqp::unique_name("cli_migrate");
    let env = [("DB_SCHEMA", schema.as_str())];
    let done = json_of(&["migrate"], &env).await;
    assert_eq!(done["migrated"], format!("\"{schema}\".\"consumer_inbox\""));
    // Idempotent; the table is there and empty.
    json_of(&["migrate"], &env).await;
    let stats = json_of(&["inbox", "stats"], &env).await;
    assert_eq!(stats, json!({ "handlers": [], "kafka_dlq_settled": null }));
    // The outbox beside it is there and empty.
    let outbox = json_of(&["outbox", "stats"], &env).await;
    assert_eq!(
        outbox["outbox"],
        format!("\"{schema}\".\"consumer_inbox_outbox\"")
    );
    assert_eq!(
        (outbox["pending"].as_u64(), outbox["published"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(outbox["oldest_pending_secs"].is_null());

    // A committed message waits until a relay publishes it.
    let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap())
        .await
        .unwrap();
    let inbox = consumer_core::Inbox::new(pool, consumer_core::InboxConfig::in_schema(&schema))
        .await
        .unwrap();
    let mut tx = inbox.pool().begin().await.unwrap();
    let message = consumer_core::OutboxMessage::new("events", "x");
    inbox.outbox().enqueue(&mut tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    let outbox = json_of(&["outbox", "stats"], &env).await;
    assert_eq!(outbox["pending"].as_u64(), Some(1), "{outbox}");
    assert!(outbox["oldest_pending_secs"].as_f64().is_some(), "{outbox}");
    let text = consumer(&["outbox", "stats"], &env).await;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("consumer_inbox_outbox"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_setting_is_named_and_no_password_is_shown() {
    let secret = "hunter2-cli-secret";
    let bad_amqp = format!("amqp://consumer:{secret}@127.0.0.1:1/%2f");
    let out = consumer(
        &["dlq", "list", "--broker", "amqp", "--queue", "q.dlq"],
        &[("AMQP_URL", bad_amqp.as_str())],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("AMQP_URL"), "{stderr}");
    assert!(!stderr.contains(secret), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains(secret));

    let bad_db = format!("postgres://consumer:{secret}@127.0.0.1:1/consumer");
    let out = consumer(&["inbox", "stats"], &[("DATABASE_URL", bad_db.as_str())]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
    assert!(!stderr.contains(secret), "{stderr}");

    // A real broker, a queue that does not exist.
    let out = consumer(
        &[
            "dlq",
            "list",
            "--broker",
            "amqp",
            "--queue",
            "no.such.queue.dlq",
        ],
        &[],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("DLQ_QUEUE"), "{stderr}");
}
