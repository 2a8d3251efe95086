//! Where `consumer dlq replay` sends a RabbitMQ dead letter, against real RabbitMQ and
//! PostgreSQL. A producer that writes the framework's headers itself (an attempt, an
//! `x-death` naming a retry queue, an `x-original-*` origin pointing at another queue, even
//! a signature) does not steer the operator's replay there: the workers replace an origin
//! they cannot verify with their origin secret, and the replay refuses one it cannot verify
//! until the operator names the destination. A message the framework retried and
//! dead-lettered itself still replays to where it was first published.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use consumer_amqp::{headers, AmqpPublisher};
use consumer_core::inbox::EntryStatus;
use consumer_core::{handler, Context, HandlerError, Worker};
use consumer_tests::amqp::{self, config, init_tracing, wait_for, worker_config, Rabbit, Running};
use consumer_tests::common::PgEnv;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::Postgres;
use support::{consumer, json_of};

mod support;

const WAIT: Duration = Duration::from_secs(60);

/// The origin secret the tests' workers ([`config`]) and the command share.
const SECRET: &str = amqp::ORIGIN_SECRET;

/// Whether the forged test's handler still rejects its message.
static FORGED_REJECTED: AtomicBool = AtomicBool::new(true);
/// Whether the genuine test's handler still fails.
static GENUINE_FAILING: AtomicBool = AtomicBool::new(true);

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

#[handler(name = "cli_origin_forged", max_attempts = 1)]
async fn forged(_ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if FORGED_REJECTED.load(Ordering::SeqCst) {
        return Err(HandlerError::permanent(format!("job {} rejected", job.id)));
    }
    Ok(())
}

#[handler(
    name = "cli_origin_genuine",
    max_attempts = 2,
    backoff = "100ms..200ms"
)]
async fn genuine(_ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if GENUINE_FAILING.load(Ordering::SeqCst) {
        return Err(HandlerError::transient(format!("job {} timed out", job.id)));
    }
    Ok(())
}

/// Publishes `body` to `queue` through the default exchange with `headers`, as any
/// producer can, and waits for the confirm.
async fn publish_raw(queue: &str, message_id: &str, body: &[u8], headers: FieldTable) {
    let conn = Connection::connect(&amqp::amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_message_id(message_id.into())
                .with_headers(headers),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    let _ = conn.close(200, "ok".into()).await;
}

/// Declares a durable queue of its own, for the test to watch.
async fn declare_queue(queue: &str) {
    let conn = Connection::connect(&amqp::amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .expect("declare");
    let _ = conn.close(200, "ok".into()).await;
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Two forgeries, both pointing at another queue: a message published to the work queue
/// dressed as the framework's own retry copy, and a "dead letter" published straight into
/// the dead-letter queue with a made-up signature. The first is dead-lettered with the
/// origin the worker saw and signed, and replays there; the second is refused until the
/// operator names the destination. Nothing reaches the other queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_origin_does_not_steer_a_replay() {
    init_tracing();
    let pg = PgEnv::new().await;
    let cfg = config(&amqp::unique_name("cliforge"));
    let dlq = cfg.dead_letter_queue_name();
    let victim = amqp::unique_name("clivictim");
    declare_queue(&victim).await;
    let inbox = pg.inbox().await;
    let worker = Worker::with_config(inbox.clone(), forged, worker_config(2)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;

    // Everything the framework's own retry copy carries, written by the producer: an
    // attempt, RabbitMQ's record of an expiry from one of this queue's retry queues, and an
    // origin naming another queue.
    let mut death = FieldTable::default();
    death.insert("reason".into(), text("expired"));
    death.insert(
        "queue".into(),
        text(&cfg.retry_queue_name(cfg.retry_delays[0])),
    );
    death.insert("exchange".into(), text(""));
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    let mut as_retry_copy = FieldTable::default();
    as_retry_copy.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(2));
    as_retry_copy.insert(
        "x-death".into(),
        AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
    );
    as_retry_copy.insert(headers::ORIGINAL_EXCHANGE.into(), text(""));
    as_retry_copy.insert(headers::ORIGINAL_ROUTING_KEY.into(), text(&victim));
    as_retry_copy.insert(
        headers::FIRST_FAILURE.into(),
        text("2001-01-01T00:00:00.000Z"),
    );
    let mut as_dead_letter = as_retry_copy.clone();
    as_dead_letter.insert(headers::DEAD_LETTER_REASON.into(), text("permanent_error"));
    as_dead_letter.insert(headers::HANDLER.into(), text("cli_origin_forged"));
    as_dead_letter.insert(headers::ORIGIN_SIGNATURE.into(), text(&"ab".repeat(32)));

    let via_queue = format!("{}-via-queue", cfg.queue);
    let via_dlq = format!("{}-via-dlq", cfg.queue);
    let body = |id: &str| json!({ "id": id }).to_string();
    publish_raw(
        &cfg.queue,
        &via_queue,
        body(&via_queue).as_bytes(),
        as_retry_copy,
    )
    .await;
    wait_for("the worker's dead letter", WAIT, || async {
        Rabbit::ready(&dlq).await == 1
    })
    .await;
    publish_raw(&dlq, &via_dlq, body(&via_dlq).as_bytes(), as_dead_letter).await;

    let env = [
        ("DB_SCHEMA", pg.schema.as_str()),
        ("DLQ_QUEUE", dlq.as_str()),
        ("DLQ_BROKER", "amqp"),
        ("AMQP_ORIGIN_SECRET", SECRET),
    ];
    // The worker's dead letter names where the worker got the message, not what the
    // producer wrote.
    let show = json_of(&["dlq", "show", &via_queue], &env).await;
    let h = &show[0]["headers"];
    assert_eq!(h[headers::ORIGINAL_EXCHANGE], "", "{show}");
    assert_eq!(
        h[headers::ORIGINAL_ROUTING_KEY],
        cfg.queue.as_str(),
        "{show}"
    );
    assert_ne!(
        h[headers::FIRST_FAILURE],
        "2001-01-01T00:00:00.000Z",
        "{show}"
    );

    // The replay takes the verified origin and refuses the other, naming the way out.
    FORGED_REJECTED.store(false, Ordering::SeqCst);
    let out = consumer(&["dlq", "replay", "--all", "--json"], &env).await;
    assert!(
        !out.status.success(),
        "one letter is refused: the command fails"
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["replayed"], 1, "{report}");
    let line = |id: &str| {
        report["messages"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["id"] == id))
            .unwrap_or_else(|| panic!("no line for {id}: {report}"))
            .clone()
    };
    assert_eq!(line(&via_queue)["fate"], "replayed", "{report}");
    assert_eq!(line(&via_dlq)["fate"], "unverified_origin", "{report}");
    let error = line(&via_dlq)["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("--to") && error.contains(&victim), "{error}");
    wait_for("the replayed message completed", WAIT, || async {
        inbox
            .entry("cli_origin_forged", &via_queue)
            .await
            .unwrap()
            .map(|e| e.status)
            == Some(EntryStatus::Completed)
    })
    .await;
    wait_for("the refused letter stays", WAIT, || async {
        Rabbit::ready(&dlq).await == 1
    })
    .await;
    assert_eq!(
        Rabbit::ready(&victim).await,
        0,
        "nothing reached the victim"
    );

    // Named explicitly, the destination is the operator's.
    let to = format!("/{}", cfg.queue);
    let done = json_of(&["dlq", "replay", "--all", "--to", &to], &env).await;
    assert_eq!(done["replayed"], 1, "{done}");
    wait_for("the second message completed", WAIT, || async {
        inbox
            .entry("cli_origin_forged", &via_dlq)
            .await
            .unwrap()
            .map(|e| e.status)
            == Some(EntryStatus::Completed)
    })
    .await;
    assert_eq!(
        Rabbit::ready(&victim).await,
        0,
        "nothing reached the victim"
    );

    running.stop().await;
    Rabbit::delete_queue(&victim).await;
    Rabbit::delete_topology(&cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_genuine_copy_still_replays_to_its_origin() {
    init_tracing();
    let pg = PgEnv::new().await;
    let mut cfg = config(&amqp::unique_name("cligenuine"));
    cfg.exchange = amqp::unique_name("cligenuine_ex");
    cfg.binding_keys = vec!["jobs.eu".to_owned()];
    let dlq = cfg.dead_letter_queue_name();
    let inbox = pg.inbox().await;
    let worker = Worker::with_config(inbox.clone(), genuine, worker_config(2)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;

    let id = format!("{}-genuine", cfg.queue);
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    publisher
        .publish_json("jobs.eu", &id, &json!({ "id": id }))
        .await
        .unwrap();
    wait_for("the dead letter", WAIT, || async {
        Rabbit::ready(&dlq).await == 1
    })
    .await;

    let env = [
        ("DB_SCHEMA", pg.schema.as_str()),
        ("DLQ_QUEUE", dlq.as_str()),
        ("DLQ_BROKER", "amqp"),
    ];
    // The origin came through a retry copy: it is the first publish's, and signed.
    let show = json_of(&["dlq", "show", &id], &env).await;
    let h = &show[0]["headers"];
    assert_eq!(
        h[headers::DEAD_LETTER_REASON],
        "max_attempts_exceeded",
        "{show}"
    );
    assert_eq!(
        h[headers::ORIGINAL_EXCHANGE],
        cfg.exchange.as_str(),
        "{show}"
    );
    assert_eq!(h[headers::ORIGINAL_ROUTING_KEY], "jobs.eu", "{show}");
    assert!(
        h[headers::FIRST_FAILURE].as_str() < h[headers::LAST_FAILURE].as_str(),
        "the first failure is carried through the retry copy: {show}"
    );

    // Without the workers' secret the command cannot tell it from a forgery.
    let out = consumer(&["dlq", "replay", "--all", "--json"], &env).await;
    assert!(!out.status.success(), "no secret, no verified origin");
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(
        report["messages"][0]["fate"], "unverified_origin",
        "{report}"
    );
    let error = report["messages"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("AMQP_ORIGIN_SECRET"), "{error}");
    assert!(!error.contains(SECRET));

    // With it, the replay goes to the origin: through the exchange, with the routing key.
    GENUINE_FAILING.store(false, Ordering::SeqCst);
    let mut with_secret = env.to_vec();
    with_secret.push(("AMQP_ORIGIN_SECRET", SECRET));
    let done = json_of(&["dlq", "replay", "--all"], &with_secret).await;
    assert_eq!(done["replayed"], 1, "{done}");
    wait_for("the replayed message completed", WAIT, || async {
        inbox
            .entry("cli_origin_genuine", &id)
            .await
            .unwrap()
            .map(|e| e.status)
            == Some(EntryStatus::Completed)
    })
    .await;
    assert_eq!(Rabbit::ready(&dlq).await, 0);

    publisher.close().await;
    running.stop().await;
    Rabbit::delete_topology(&cfg).await;
}
