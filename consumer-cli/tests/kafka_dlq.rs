//! The `consumer` command against a real Kafka-protocol broker and PostgreSQL: a worker
//! dead-letters five records for two reasons; `dlq list` groups them; once the cause is
//! fixed, `dlq replay --reason` runs those records once (their keys end completed), the
//! others stay listed, and a second replay runs nothing. A `copy_too_large` letter (a
//! reference to a record too large to copy) replays the record it refers to, and is refused,
//! naming where it looked, when that record is not there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use consumer_core::{handler, Context, HandlerError};
use consumer_kafka::headers;
use consumer_tests::kafka::{self, header, read_topic, worker_config, KafkaEnv, Running};
use rdkafka::message::Headers as _;
use rdkafka::Message;
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;
use support::{json_of, wait_completed};

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
    wait_completed(&inbox, HANDLER, &rejected, WAIT).await;
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

/// A record too large to copy (over the worker's payload limit and the transport's copy
/// limit) is dead-lettered as a reference to where it is; replaying that letter republishes
/// the record itself (key, value, its own headers) to its topic, not the reference, and
/// settles the letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replaying_a_copy_too_large_letter_republishes_the_original_record() {
    let env = KafkaEnv::new("clihuge", 1).await;
    let dlq = format!("{}.dlq", env.topic);
    // Only the topic's broker limit and the test's own producer are raised, to write the
    // record in the first place.
    kafka::set_topic_config(&env.topic, "max.message.bytes", "4000000").await;
    let mut props = consumer_kafka::ClientProperties::new();
    props.set("message.max.bytes", "4000000");
    let publisher =
        consumer_kafka::KafkaPublisher::connect(&kafka::brokers(), &props).expect("publisher");
    let id = format!("{}-huge", env.topic);
    let body = json!({ "id": id, "pad": "x".repeat(1_200_000) }).to_string();
    let original = publisher
        .publish(
            &env.topic,
            Some(b"huge-key"),
            Some(&id),
            body.as_bytes(),
            &[("trace-id", "t-9")],
        )
        .await
        .expect("publish")
        .offset;

    let running = Running::start_handler(&env, orders, env.config(), worker_config(2)).await;
    let dead = read_topic(&dlq, 1, 1, WAIT).await;
    running.stop().await;
    assert_eq!(dead.len(), 1, "one dead letter");
    assert_eq!(
        header(&dead[0], headers::DEAD_LETTER_REASON).as_deref(),
        Some("copy_too_large")
    );

    let env_vars = [
        ("DB_SCHEMA", env.pg.schema.as_str()),
        ("DLQ_TOPIC", dlq.as_str()),
        ("DLQ_BROKER", "kafka"),
    ];
    let done = json_of(&["dlq", "replay", "--all"], &env_vars).await;
    assert_eq!(done["replayed"], 1, "{done}");

    // The record after the original is its replayed copy: the original's key, value and
    // headers, none of the letter's.
    let all = read_topic(&env.topic, 1, 2, WAIT).await;
    assert_eq!(all.len(), 2, "the original and its replayed copy");
    assert_eq!(all[0].offset(), original);
    let copy = &all[1];
    assert_eq!(copy.key(), Some(b"huge-key".as_slice()));
    assert!(
        copy.payload() == Some(body.as_bytes()),
        "the original value, not the reference ({} bytes: {:?})",
        copy.payload().map_or(0, <[u8]>::len),
        copy.payload()
            .map(|p| String::from_utf8_lossy(&p[..p.len().min(120)]).into_owned())
    );
    assert_eq!(header(copy, "trace-id").as_deref(), Some("t-9"));
    assert_eq!(header(copy, "message_id").as_deref(), Some(id.as_str()));
    let names: Vec<String> = copy
        .headers()
        .map(|hs| hs.iter().map(|h| h.key.to_owned()).collect())
        .unwrap_or_default();
    for name in &names {
        assert!(
            !name.starts_with("x-"),
            "{name} on the replayed copy: {names:?}"
        );
    }

    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 0, "the letter is settled: {list}");
}

/// A `copy_too_large` letter whose record is not at the place it names (deleted by
/// retention, or never there) is not replayed: the replay fails naming the topic,
/// partition and offset, republishes nothing, and the letter stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_a_copy_too_large_letter_whose_record_is_gone_is_refused() {
    let env = KafkaEnv::new("cligone", 1).await;
    let dlq = format!("{}.dlq", env.topic);
    let publisher = env.publisher();
    let id = format!("{}-gone", env.topic);
    publisher
        .publish(&env.topic, None, Some("other"), b"{}", &[])
        .await
        .expect("publish");
    // The letter as the transport writes it, for a record at offset 7 of a partition that
    // holds one record.
    let reference = json!({ "topic": env.topic, "partition": 0, "offset": 7 }).to_string();
    publisher
        .publish(
            &dlq,
            None,
            Some(&id),
            reference.as_bytes(),
            &[
                (headers::DEAD_LETTER_REASON, "copy_too_large"),
                (headers::HANDLER, HANDLER),
                (headers::ERROR, "payload_too_large: too large"),
                (headers::ORIGINAL_TOPIC, env.topic.as_str()),
                (headers::ORIGINAL_PARTITION, "0"),
                (headers::ORIGINAL_OFFSET, "7"),
            ],
        )
        .await
        .expect("publish the letter");

    let env_vars = [
        ("DB_SCHEMA", env.pg.schema.as_str()),
        ("DLQ_TOPIC", dlq.as_str()),
        ("DLQ_BROKER", "kafka"),
    ];
    let out = support::consumer(&["dlq", "replay", "--all", "--json"], &env_vars).await;
    assert!(!out.status.success(), "the replay must fail");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["replayed"], 0, "{report}");
    let error = report["messages"][0]["error"].as_str().unwrap_or_default();
    for part in [env.topic.as_str(), "partition 0", "offset 7"] {
        assert!(error.contains(part), "{part:?} in {error:?}");
    }
    // Nothing was republished, and the letter is still there.
    let topic = read_topic(&env.topic, 1, 2, Duration::from_secs(3)).await;
    assert_eq!(topic.len(), 1, "nothing republished");
    let list = json_of(&["dlq", "list"], &env_vars).await;
    assert_eq!(list["total"], 1, "{list}");
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
