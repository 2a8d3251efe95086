//! The `consumer` command against a real Kafka-protocol broker and PostgreSQL: a worker
//! dead-letters five records for two reasons; `dlq list` groups them; once the cause is
//! fixed, `dlq replay --reason` runs those records once (their keys end completed), the
//! others stay listed, and a second replay runs nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use consumer_core::{handler, Context, EntryStatus, HandlerError};
use consumer_kafka::headers;
use consumer_tests::kafka::{header, read_topic, wait_for, worker_config, KafkaEnv, Running};
use rdkafka::Message;
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;
use support::json_of;

mod support;

/// The cause of the `rejected` records' failures: fixed half-way through the test.
static FIXED: AtomicBool = AtomicBool::new(false);

const HANDLER: &str = "cli_kafka_orders";
const WAIT: Duration = Duration::from_secs(90);

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

#[handler(name = "cli_kafka_orders", max_attempts = 2, backoff = "200ms..400ms")]
async fn orders(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if !FIXED.load(Ordering::SeqCst) {
        return Err(HandlerError::permanent(format!(
            "order {} rejected by the provider",
            job.id
        )));
    }
    sqlx::query("INSERT INTO effects (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
        .execute(ctx.db())
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_dead_letters_are_grouped_and_replayed_once() {
    let env = KafkaEnv::new("clidlq", 1).await;
    let dlq = format!("{}.dlq", env.topic);
    let running = Running::start_handler(&env, orders, env.config(), worker_config(4)).await;
    let publisher = env.publisher();
    let rejected: Vec<String> = (0..3).map(|i| format!("{}-r{i}", env.topic)).collect();
    for id in &rejected {
        let body = json!({ "id": id }).to_string();
        publisher
            .publish(
                &env.topic,
                Some(id.as_bytes()),
                Some(id),
                body.as_bytes(),
                &[],
            )
            .await
            .expect("publish");
    }
    for i in 0..2 {
        let id = format!("{}-garbage{i}", env.topic);
        publisher
            .publish(
                &env.topic,
                Some(id.as_bytes()),
                Some(&id),
                b"{not json",
                &[],
            )
            .await
            .expect("publish");
    }
    let dead = read_topic(&dlq, 1, 5, WAIT).await;
    assert_eq!(dead.len(), 5, "5 dead letters");

    let env_vars = [
        ("DB_SCHEMA", env.pg.schema.as_str()),
        ("DLQ_TOPIC", dlq.as_str()),
        ("DLQ_BROKER", "kafka"),
    ];
    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 5, "{list}");
    let groups = list["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 2, "{list}");
    assert_eq!(groups[0]["reason"], "permanent_error", "{list}");
    assert_eq!(groups[0]["count"], 3, "{list}");
    assert_eq!(groups[0]["fingerprint"], "order # rejected by the provider");
    assert_eq!(groups[1]["reason"], "undecodable", "{list}");
    assert_eq!(groups[1]["count"], 2, "{list}");

    let dry = json_of(
        &["dlq", "replay", "--reason", "permanent_error", "--dry-run"],
        &env_vars,
    )
    .await;
    assert_eq!(dry["selected"], 3, "{dry}");
    assert_eq!(dry["replayed"], 0, "{dry}");

    FIXED.store(true, Ordering::SeqCst);
    let replay = ["dlq", "replay", "--reason", "permanent_error"];
    let done = json_of(&replay, &env_vars).await;
    assert_eq!(done["replayed"], 3, "{done}");
    let inbox = env.pg.inbox().await;
    wait_for("the replayed records completed", WAIT, || async {
        for id in &rejected {
            let e = inbox.entry(HANDLER, id).await.unwrap();
            if e.map(|e| e.status) != Some(EntryStatus::Completed) {
                return false;
            }
        }
        true
    })
    .await;
    let effects = env.effects().await;
    for id in &rejected {
        let n = effects.iter().filter(|(j, _)| j == id).count();
        assert_eq!(n, 1, "{id} ran once: {effects:?}");
    }

    // The replayed copies went back to the topic, without the dead letter's headers.
    let all = read_topic(&env.topic, 1, 8, WAIT).await;
    assert_eq!(all.len(), 8, "5 records and 3 replayed copies");
    for copy in &all[5..] {
        let id = header(copy, "message-id").or_else(|| header(copy, "x-message-id"));
        for name in [
            headers::DEAD_LETTER_REASON,
            headers::ERROR,
            headers::ATTEMPT,
            headers::ATTEMPTS,
            headers::ORIGINAL_TOPIC,
        ] {
            assert_eq!(header(copy, name), None, "{name} on the copy of {id:?}");
        }
        assert!(copy.payload().is_some_and(|p| !p.is_empty()));
    }

    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 2, "{list}");
    assert_eq!(list["groups"][0]["reason"], "undecodable", "{list}");
    let again = json_of(&replay, &env_vars).await;
    assert_eq!(again["selected"], 0, "{again}");
    assert_eq!(again["replayed"], 0, "{again}");

    let purged = json_of(&["dlq", "purge", "--all"], &env_vars).await;
    assert_eq!(purged["purged"], 2, "{purged}");
    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 0, "{list}");

    running.stop().await;
    let effects = env.effects().await;
    assert_eq!(effects.len(), 3, "nothing ran twice: {effects:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_or_topic_that_does_not_work_is_named() {
    let out = support::consumer(
        &["dlq", "list", "--broker", "kafka", "--topic", "t.dlq"],
        &[("KAFKA_BROKERS", "127.0.0.1:1")],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("KAFKA_BROKERS"), "{stderr}");

    let schema = consumer_tests::common::unique("cli_kafka");
    let out = support::consumer(
        &[
            "dlq",
            "list",
            "--broker",
            "kafka",
            "--topic",
            "no_such_topic_cli.dlq",
        ],
        &[("DB_SCHEMA", schema.as_str())],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("DLQ_TOPIC"), "{stderr}");
}

/// The marks of settled dead letters expire once their records have left the topic and
/// the marks are older than `--settled-retention`; a mark whose record is still in the topic
/// is kept, so that record is never shown or replayed again. `inbox stats` counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_dead_letter_marks_expire() {
    let env = KafkaEnv::new("clisettled", 1).await;
    let dlq = format!("{}.dlq", env.topic);
    env.publisher()
        .publish(&dlq, Some(b"k"), Some("m-1"), b"{}", &[])
        .await
        .expect("publish");
    read_topic(&dlq, 1, 1, WAIT).await;
    let env_vars = [
        ("DB_SCHEMA", env.pg.schema.as_str()),
        ("DLQ_TOPIC", dlq.as_str()),
        ("DLQ_BROKER", "kafka"),
    ];
    // The record at offset 0 is purged: its mark is written.
    let purged = json_of(&["dlq", "purge", "--all"], &env_vars).await;
    assert_eq!(purged["purged"], 1, "{purged}");
    // Marks of records gone from the topic (offsets it never had), one recent, one old; and
    // the mark of the record still there made old.
    let pool = env.pg.pool(1).await;
    let table = "consumer_inbox_dlq_settled";
    sqlx::query(&format!(
        "INSERT INTO {table} (topic, part, record_offset, fate, settled_at) VALUES \
         ($1, 0, 1000, 'purged', now() - interval '8 days'), \
         ($1, 0, 1001, 'purged', now() - interval '1 day')"
    ))
    .bind(&dlq)
    .execute(&pool)
    .await
    .expect("insert the marks");
    sqlx::query(&format!(
        "UPDATE {table} SET settled_at = now() - interval '30 days' WHERE record_offset = 0"
    ))
    .execute(&pool)
    .await
    .expect("age the mark");

    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 0, "the purged record stays settled: {list}");
    let left: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT record_offset FROM {table} ORDER BY record_offset"
    ))
    .fetch_all(&pool)
    .await
    .expect("read the marks");
    assert_eq!(
        left,
        [0, 1001],
        "only the old mark of a record gone expired"
    );

    let stats = json_of(&["inbox", "stats"], &env_vars).await;
    assert_eq!(stats["kafka_dlq_settled"]["marks"], 2, "{stats}");
    assert!(
        stats["kafka_dlq_settled"]["oldest_secs"].as_f64() > Some(29.0 * 86_400.0),
        "{stats}"
    );
}
