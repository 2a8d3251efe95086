//! The Kafka transport: the retry-topic path (non-blocking) and the blocking
//! in-place path both work; poison and undecodable records end in the dead-letter topic
//! with the documented headers; no valid record is dead-lettered.

use std::collections::HashMap;
use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::{handler, Context, HandlerError};
use consumer_kafka::{headers, RetryMode};
use consumer_tests::kafka::{
    self, committed_offsets, header, read_topic, wait_for, worker_config, Job, KafkaEnv, Running,
};
use rdkafka::Message;
use serde_json::json;
use sqlx::Postgres;

async fn publish(
    env: &KafkaEnv,
    key: &str,
    id: &str,
    payload: &[u8],
    extra: &[(&str, &str)],
) -> i64 {
    env.publisher()
        .publish(&env.topic, Some(key.as_bytes()), Some(id), payload, extra)
        .await
        .expect("publish")
        .offset
}

fn job(id: &str, extra: serde_json::Value) -> Vec<u8> {
    let mut body = json!({ "id": id });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string().into_bytes()
}

fn seq_of(effects: &[(String, i32)], job: &str) -> usize {
    effects
        .iter()
        .position(|(j, _)| j == job)
        .unwrap_or_else(|| panic!("{job} has no effect: {effects:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_topic_path_does_not_block_the_partition() {
    let env = KafkaEnv::new("retrytopic", 1).await;
    // One partition, strict partition order: only the retry topic lets later records pass.
    publish(&env, "r", "r", &job("r", json!({ "fail_times": 2 })), &[]).await;
    for i in 0..5 {
        let id = format!("after-{i}");
        publish(&env, &id, &id, &job(&id, json!({})), &[]).await;
    }
    let end = publish(&env, "x", "x", &job("x", json!({ "fail_times": 9 })), &[]).await + 1;

    let running = Running::start(&env, env.config(), worker_config(4)).await;
    let dlq = format!("{}.dlq", env.topic);
    wait_for(
        "r to succeed on attempt 3",
        Duration::from_secs(60),
        || async { env.effects().await.iter().any(|(j, a)| j == "r" && *a == 3) },
    )
    .await;
    let dead = read_topic(&dlq, 1, 1, Duration::from_secs(60)).await;
    wait_for(
        "the main topic to be committed",
        Duration::from_secs(30),
        || async { env.committed_up_to(&[end]).await },
    )
    .await;
    let stats = running.stop().await;

    let effects = env.effects().await;
    assert_eq!(effects.len(), 6, "{effects:?}");
    assert!(
        seq_of(&effects, "after-0") < seq_of(&effects, "r"),
        "records behind the failing one were not held up: {effects:?}"
    );
    assert_eq!(stats.retries, 4, "r twice, x twice: {stats:?}");

    // The retry topic holds the copies, with attempt, due time, identity and origin.
    let copies = read_topic(
        &format!("{}.retry", env.topic),
        1,
        4,
        Duration::from_secs(30),
    )
    .await;
    let mut of_r: Vec<_> = copies
        .iter()
        .filter(|m| header(m, "message_id").as_deref() == Some("r"))
        .collect();
    of_r.sort_by_key(|m| m.offset());
    assert_eq!(of_r.len(), 2, "{copies:?}");
    for (copy, attempt) in of_r.iter().zip(["2", "3"]) {
        assert_eq!(header(copy, headers::ATTEMPT).as_deref(), Some(attempt));
        assert!(header(copy, headers::DUE_AT).is_some_and(|d| d.parse::<i64>().is_ok()));
        assert_eq!(
            header(copy, headers::RETRY_GROUP).as_deref(),
            Some(env.group.as_str())
        );
        assert_eq!(
            header(copy, headers::ORIGINAL_TOPIC).as_deref(),
            Some(env.topic.as_str())
        );
        assert_eq!(header(copy, headers::ORIGINAL_OFFSET).as_deref(), Some("0"));
        assert_eq!(copy.key(), Some(&b"r"[..]));
    }

    // x failed on every attempt: after max_attempts (3) it is dead-lettered from the retry
    // topic, with its original position.
    assert_eq!(dead.len(), 1, "{dead:?}");
    let x = &dead[0];
    assert_eq!(header(x, "message_id").as_deref(), Some("x"));
    assert_eq!(
        header(x, headers::DEAD_LETTER_REASON).as_deref(),
        Some("max_attempts_exceeded")
    );
    assert_eq!(header(x, headers::ATTEMPTS).as_deref(), Some("3"));
    assert_eq!(
        header(x, headers::ORIGINAL_TOPIC).as_deref(),
        Some(env.topic.as_str())
    );
    assert_eq!(
        header(x, headers::ORIGINAL_OFFSET).as_deref(),
        Some((end - 1).to_string().as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_retry_keeps_strict_order() {
    let env = KafkaEnv::new("blocking", 1).await;
    publish(&env, "b", "b", &job("b", json!({ "fail_times": 2 })), &[]).await;
    let mut end = 0;
    for i in 0..3 {
        let id = format!("after-{i}");
        end = publish(&env, &id, &id, &job(&id, json!({})), &[]).await + 1;
    }
    let mut config = env.config();
    config.retry = RetryMode::Blocking;
    let running = Running::start(&env, config, worker_config(4)).await;
    wait_for(
        "four effects and the offsets committed",
        Duration::from_secs(60),
        || async { env.effect_count().await == 4 && env.committed_up_to(&[end]).await },
    )
    .await;
    let stats = running.stop().await;

    let effects = env.effects().await;
    assert_eq!(
        effects,
        vec![
            ("b".to_owned(), 3),
            ("after-0".to_owned(), 1),
            ("after-1".to_owned(), 1),
            ("after-2".to_owned(), 1),
        ],
        "the failing record held its place until it succeeded"
    );
    assert_eq!(stats.retries, 2, "{stats:?}");
    let copies = read_topic(
        &format!("{}.retry", env.topic),
        1,
        1,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        copies.is_empty(),
        "the blocking path writes no retry copies: {copies:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_undecodable_records_are_dead_lettered_with_their_headers() {
    let env = KafkaEnv::new("dlq", 1).await;
    let mut offsets = HashMap::new();
    for (key, id, payload) in [
        ("v1", "valid-1", job("valid-1", json!({}))),
        ("p", "poison", job("poison", json!({ "permanent": true }))),
        ("u", "bad-json", b"{not json".to_vec()),
        ("v2", "valid-2", job("valid-2", json!({}))),
        ("w", "wrong-shape", br#"{"no_id": 1}"#.to_vec()),
        ("v3", "valid-3", job("valid-3", json!({}))),
    ] {
        let offset = publish(
            &env,
            key,
            id,
            &payload,
            &[("trace-id", &format!("trace-{id}"))],
        )
        .await;
        offsets.insert(id, offset);
    }
    let end = offsets.values().max().copied().unwrap_or_default() + 1;
    let running = Running::start(&env, env.config(), worker_config(4)).await;
    let dlq = format!("{}.dlq", env.topic);
    let dead = read_topic(&dlq, 1, 3, Duration::from_secs(60)).await;
    wait_for(
        "valid records to take effect and offsets to be committed",
        Duration::from_secs(60),
        || async { env.effect_count().await == 3 && env.committed_up_to(&[end]).await },
    )
    .await;
    let stats = running.stop().await;
    // Nothing else arrives in the dead-letter topic.
    let again = read_topic(&dlq, 1, 4, Duration::from_secs(2)).await;
    assert_eq!(again.len(), 3, "{again:?}");

    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    let mut by_id: HashMap<String, &rdkafka::message::OwnedMessage> = HashMap::new();
    for d in &dead {
        by_id.insert(header(d, "message_id").expect("message id kept"), d);
    }
    let mut ids: Vec<_> = by_id.keys().cloned().collect();
    ids.sort();
    assert_eq!(
        ids,
        ["bad-json", "poison", "wrong-shape"],
        "no valid record is dead-lettered"
    );

    for (id, key, reason, attempts, payload) in [
        (
            "poison",
            "p",
            "permanent_error",
            "1",
            job("poison", json!({ "permanent": true })),
        ),
        ("bad-json", "u", "undecodable", "0", b"{not json".to_vec()),
        (
            "wrong-shape",
            "w",
            "undecodable",
            "0",
            br#"{"no_id": 1}"#.to_vec(),
        ),
    ] {
        let d = by_id[id];
        assert_eq!(d.key(), Some(key.as_bytes()), "{id}: original key");
        assert_eq!(
            d.payload(),
            Some(payload.as_slice()),
            "{id}: original value"
        );
        assert_eq!(
            header(d, "trace-id"),
            Some(format!("trace-{id}")),
            "{id}: original headers"
        );
        assert_eq!(
            header(d, headers::DEAD_LETTER_REASON).as_deref(),
            Some(reason),
            "{id}"
        );
        assert_eq!(
            header(d, headers::HANDLER).as_deref(),
            Some("kafka_record"),
            "{id}"
        );
        assert_eq!(
            header(d, headers::KEY).as_deref(),
            Some(id),
            "{id}: the message id is its key"
        );
        assert_eq!(
            header(d, headers::ATTEMPTS).as_deref(),
            Some(attempts),
            "{id}"
        );
        assert!(
            header(d, headers::ERROR).is_some_and(|e| !e.is_empty()),
            "{id}"
        );
        assert_eq!(
            header(d, headers::ORIGINAL_TOPIC).as_deref(),
            Some(env.topic.as_str())
        );
        assert_eq!(header(d, headers::ORIGINAL_PARTITION).as_deref(), Some("0"));
        assert_eq!(
            header(d, headers::ORIGINAL_OFFSET),
            Some(offsets[id].to_string()),
            "{id}"
        );
    }
    let mut done: Vec<String> = env.effects().await.into_iter().map(|(j, _)| j).collect();
    done.sort();
    assert_eq!(done, ["valid-1", "valid-2", "valid-3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_sharing_a_topic_run_only_their_own_retry_copies() {
    let a = KafkaEnv::new("shared", 1).await;
    let b = a.sharing_topic().await;
    publish(&a, "r", "r", &job("r", json!({ "fail_times": 1 })), &[]).await;
    let end = publish(&a, "s", "s", &job("s", json!({})), &[]).await + 1;

    let run_a = Running::start(&a, a.config(), worker_config(4)).await;
    let run_b = Running::start(&b, b.config(), worker_config(4)).await;
    for env in [&a, &b] {
        wait_for(
            "r to succeed on attempt 2 in each group",
            Duration::from_secs(60),
            || async {
                env.effects()
                    .await
                    .iter()
                    .any(|(j, at)| j == "r" && *at == 2)
                    && env.committed_up_to(&[end]).await
            },
        )
        .await;
    }
    // Both groups' copies are in the shared retry topic...
    let copies = read_topic(&format!("{}.retry", a.topic), 1, 2, Duration::from_secs(30)).await;
    assert_eq!(copies.len(), 2, "{copies:?}");
    // ...and each group ran only its own: the original and one copy of r, and s.
    let (sa, sb) = (run_a.stop().await, run_b.stop().await);
    for (stats, env) in [(sa, &a), (sb, &b)] {
        assert_eq!(
            (stats.received, stats.handler_runs, stats.duplicates),
            (3, 3, 0),
            "{stats:?}"
        );
        assert_eq!(
            env.effects().await,
            vec![("s".to_owned(), 1), ("r".to_owned(), 2)]
        );
    }
}

/// Fails its first attempt; its retry copy is due an hour later, so it waits in the retry
/// topic for the whole test.
#[handler(name = "kafka_record", max_attempts = 3, backoff = "1h..1h")]
async fn fails_once_retries_late(
    ctx: &mut Context<'_, Postgres>,
    job: Job,
) -> Result<(), HandlerError> {
    if ctx.attempt() == 1 {
        return Err(HandlerError::transient(format!(
            "job {} fails once",
            job.id
        )));
    }
    Ok(())
}

/// A record read again by another consumer group while the first group's retry copy waits
/// (the handler redeployed under a new group) is not superseded by that copy: the new group
/// skips the first group's copies, so the copy would never reach it, and superseding would
/// lose the message. It runs as the next attempt instead. (A replay through the same group,
/// which will read the copy, is superseded: see `exactly_once.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_read_by_another_group_is_not_superseded_by_a_copy_it_never_reads() {
    let env = KafkaEnv::new("superseded", 1).await;
    let end = publish(&env, "r", "r", &job("r", json!({})), &[]).await + 1;

    let first = Running::start_handler(
        &env,
        fails_once_retries_late,
        env.config(),
        worker_config(2),
    )
    .await;
    let inbox = env.pg.inbox().await;
    wait_for(
        "r's retry copy written and recorded, the record committed",
        Duration::from_secs(60),
        || async {
            let entry = inbox.entry("kafka_record", "r").await.expect("entry");
            entry.is_some_and(|e| e.retried_to == 2) && env.committed_up_to(&[end]).await
        },
    )
    .await;
    let stats = first.stop().await;
    assert_eq!((stats.handler_runs, stats.retries), (1, 1), "{stats:?}");

    let mut config = env.config();
    config.group_id = format!("{}-again", env.group);
    let group = config.group_id.clone();
    let again =
        Running::start_handler(&env, fails_once_retries_late, config, worker_config(2)).await;
    wait_for(
        "the second group's reading of r run, and committed",
        Duration::from_secs(60),
        || async {
            let committed = committed_offsets(&group, &env.topic, 1).await;
            again.stats().completed == 1 && committed[0].is_some_and(|c| c >= end)
        },
    )
    .await;
    let stats = again.stop().await;
    assert_eq!(
        (stats.handler_runs, stats.superseded, stats.dead_lettered),
        (1, 0, 0),
        "{stats:?}"
    );
    let entry = inbox
        .entry("kafka_record", "r")
        .await
        .expect("entry")
        .expect("row");
    assert_eq!(
        (entry.status, entry.attempts),
        (EntryStatus::Completed, 2),
        "{entry:?}"
    );
}

/// A record on the retry topic without `x-retry-group` was not written by this transport:
/// its `x-due-at` (an hour away here) does not hold the retry partition back, and the
/// records behind it run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_record_without_group_is_not_ours() {
    let env = KafkaEnv::new("nogroup", 1).await;
    let retry = format!("{}.retry", env.topic);
    let publisher = env.publisher();
    let due = (std::time::SystemTime::now() + Duration::from_secs(3600))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    for id in ["stray", "behind"] {
        let mut extra = vec![(headers::ATTEMPT, "2")];
        if id == "stray" {
            extra.push((headers::DUE_AT, due.as_str()));
        }
        publisher
            .publish(
                &retry,
                Some(id.as_bytes()),
                Some(id),
                &job(id, json!({})),
                &extra,
            )
            .await
            .expect("publish to the retry topic");
    }
    let running = Running::start(&env, env.config(), worker_config(2)).await;
    wait_for("both records to run", Duration::from_secs(60), || async {
        env.effect_count().await == 2
    })
    .await;
    running.stop().await;
    let mut ran: Vec<String> = env.effects().await.into_iter().map(|(j, _)| j).collect();
    ran.sort();
    assert_eq!(ran, ["behind", "stray"]);
}

/// The origin headers (`x-original-*`, `x-first-failure`) a producer put on a record are
/// replaced in its retry copies and dead letter by where the transport read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_supplied_original_headers_are_replaced() {
    let env = KafkaEnv::new("spoof", 1).await;
    let forged = [
        (headers::ORIGINAL_TOPIC, "forged-topic"),
        (headers::ORIGINAL_PARTITION, "77"),
        (headers::ORIGINAL_OFFSET, "12345"),
        (headers::FIRST_FAILURE, "1999-01-01T00:00:00.000Z"),
        (headers::KEY, "forged-key"),
        ("trace-id", "t-7"),
    ];
    let poison = publish(
        &env,
        "p",
        "p",
        &job("p", json!({ "fail_times": 9 })),
        &forged,
    )
    .await;
    let permanent = publish(
        &env,
        "q",
        "q",
        &job("q", json!({ "permanent": true })),
        &forged,
    )
    .await;
    let running = Running::start(&env, env.config(), worker_config(2)).await;
    let dlq = format!("{}.dlq", env.topic);
    let dead = read_topic(&dlq, 1, 2, Duration::from_secs(60)).await;
    running.stop().await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    for d in &dead {
        let id = header(d, "message_id").unwrap();
        let offset = if id == "p" { poison } else { permanent };
        assert_eq!(
            header(d, headers::ORIGINAL_TOPIC).as_deref(),
            Some(env.topic.as_str()),
            "{id}"
        );
        assert_eq!(
            header(d, headers::ORIGINAL_PARTITION).as_deref(),
            Some("0"),
            "{id}"
        );
        assert_eq!(
            header(d, headers::ORIGINAL_OFFSET),
            Some(offset.to_string()),
            "{id}"
        );
        assert_eq!(header(d, headers::FIRST_FAILURE), None, "{id}");
        assert_eq!(
            header(d, headers::KEY).as_deref(),
            Some(id.as_str()),
            "{id}"
        );
        assert_eq!(header(d, "trace-id").as_deref(), Some("t-7"), "{id}");
    }
}

/// Copies that are large, on default settings. A record of ~1,010,000 bytes (below the
/// worker's 1 MiB payload limit, above librdkafka's default `message.max.bytes`) that fails
/// is dead-lettered whole; one too large to copy at all (1,200,000 bytes, over the worker's
/// limit too) is dead-lettered as a reference to where it is, with reason
/// `copy_too_large`. Neither holds its partition: the record behind them runs and the
/// offsets are committed past all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_too_large_is_dead_lettered_with_a_reference() {
    let env = KafkaEnv::new("toolarge", 1).await;
    // Only the main topic's broker limit and the test's own producer are raised, to write
    // the records in the first place; the retry and dead-letter topics keep the defaults.
    kafka::set_topic_config(&env.topic, "max.message.bytes", "4000000").await;
    let mut props = consumer_kafka::ClientProperties::new();
    props.set("message.max.bytes", "4000000");
    let publisher =
        consumer_kafka::KafkaPublisher::connect(&kafka::brokers(), &props).expect("publisher");
    let padded = |id: &str, size: usize| {
        let mut body = job(id, json!({ "permanent": true }));
        let pad = size - body.len() - r#","pad":"""#.len();
        body.pop();
        body.extend_from_slice(format!(r#","pad":"{}"}}"#, "x".repeat(pad)).as_bytes());
        assert_eq!(body.len(), size);
        body
    };
    let mut offsets = HashMap::new();
    for (id, body) in [
        ("big", padded("big", 1_010_000)),
        ("huge", padded("huge", 1_200_000)),
        ("after", job("after", json!({}))),
    ] {
        let offset = publisher
            .publish(&env.topic, Some(id.as_bytes()), Some(id), &body, &[])
            .await
            .expect("publish")
            .offset;
        offsets.insert(id, (offset, body));
    }
    let end = offsets["after"].0 + 1;

    let running = Running::start(&env, env.config(), worker_config(2)).await;
    wait_for(
        "the record behind the large ones to run and all to be committed",
        Duration::from_secs(60),
        || async { env.effect_count().await == 1 && env.committed_up_to(&[end]).await },
    )
    .await;
    let stats = running.stop().await;
    let dead = read_topic(&format!("{}.dlq", env.topic), 1, 2, Duration::from_secs(30)).await;
    println!("{stats:?}");
    assert_eq!(dead.len(), 2, "{dead:?}");
    let by_id: HashMap<String, &rdkafka::message::OwnedMessage> = dead
        .iter()
        .map(|m| (header(m, "message_id").unwrap_or_default(), m))
        .collect();

    let big = by_id["big"];
    assert_eq!(
        header(big, headers::DEAD_LETTER_REASON).as_deref(),
        Some("permanent_error")
    );
    assert_eq!(
        big.payload(),
        Some(offsets["big"].1.as_slice()),
        "the whole record"
    );

    let huge = by_id["huge"];
    assert_eq!(
        header(huge, headers::DEAD_LETTER_REASON).as_deref(),
        Some("copy_too_large")
    );
    let reference: serde_json::Value =
        serde_json::from_slice(huge.payload().expect("a reference")).expect("JSON");
    assert_eq!(
        reference,
        json!({ "topic": env.topic, "partition": 0, "offset": offsets["huge"].0 })
    );
    let error = header(huge, headers::ERROR).unwrap();
    assert!(error.starts_with("payload_too_large"), "{error}");
    assert_eq!(
        header(huge, headers::ORIGINAL_OFFSET),
        Some(offsets["huge"].0.to_string())
    );
}
