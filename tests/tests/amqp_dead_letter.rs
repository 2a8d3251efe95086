//! RabbitMQ: a poison message ends in the dead-letter queue with the documented
//! headers after `max_attempts`; an undecodable payload ends there at once; a permanent
//! error too; no valid message is dead-lettered.

use std::collections::BTreeMap;

use consumer_amqp::{headers, AmqpPublisher};
use consumer_core::{handler, Context, HandlerError, Worker};
use consumer_tests::amqp::{
    self, config, init_tracing, wait_for, worker_config, Got, Rabbit, Running, LONG,
};
use consumer_tests::common::PgEnv;
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    #[serde(default)]
    poison: bool,
    #[serde(default)]
    permanent: bool,
}

#[handler(name = "picky", max_attempts = 3, backoff = "200ms..1s")]
async fn picky(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if job.poison {
        return Err(HandlerError::transient(format!("{} is poison", job.id)));
    }
    if job.permanent {
        return Err(HandlerError::permanent(format!(
            "{} can never work",
            job.id
        )));
    }
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
        .execute(ctx.db())
        .await?;
    Ok(())
}

const VALID: usize = 20;
const ROUTING_KEY: &str = "jobs.new";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_and_undecodable_messages_are_dead_lettered_with_their_story() {
    init_tracing();
    let pg = PgEnv::new().await;
    let mut cfg = config(&amqp::unique_name("dlq"));
    // Published through an exchange, so the dead letters must remember it even after the
    // retries came back through the default exchange.
    cfg.exchange = amqp::unique_name("x");
    cfg.binding_keys = vec![ROUTING_KEY.to_owned()];
    let inbox = pg.inbox().await;
    let worker = Worker::with_config(inbox.clone(), picky, worker_config(4)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;

    let id = |name: &str| format!("{}-{name}", cfg.queue);
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    let trace = BTreeMap::from([("trace-id".to_owned(), "t-42".to_owned())]);
    let poison_body = json!({"id": id("poison"), "poison": true}).to_string();
    publisher
        .publish(ROUTING_KEY, &id("poison"), poison_body.as_bytes(), &trace)
        .await
        .unwrap();
    publisher
        .publish(ROUTING_KEY, &id("garbage"), b"{not json", &trace)
        .await
        .unwrap();
    publisher
        .publish_json(ROUTING_KEY, &id("wrong-shape"), &json!({"no_id": 1}))
        .await
        .unwrap();
    publisher
        .publish_json(
            ROUTING_KEY,
            &id("permanent"),
            &json!({"id": id("permanent"), "permanent": true}),
        )
        .await
        .unwrap();
    for i in 0..VALID {
        let v = id(&format!("valid-{i}"));
        publisher
            .publish_json(ROUTING_KEY, &v, &json!({"id": v}))
            .await
            .unwrap();
    }
    let unroutable = publisher
        .publish_json("no.such.key", &id("lost"), &json!({"id": "lost"}))
        .await
        .unwrap_err();
    assert!(unroutable.is_unroutable(), "{unroutable}");
    publisher.close().await;

    let dlq = cfg.dead_letter_queue_name();
    wait_for("4 dead letters and 20 valid jobs", LONG, || async {
        let valid: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(inbox.pool())
            .await
            .unwrap();
        valid == VALID as i64 && Rabbit::ready(&dlq).await >= 4
    })
    .await;
    // A broker restart by a parallel test may requeue a message whose copy was already
    // published: then a dead letter can arrive twice, or a retry come back early.
    let reconnected = running.health.sessions() > 1;
    let stats = running.stop().await;
    let dead: BTreeMap<String, Got> = Rabbit::take_all(&dlq)
        .await
        .into_iter()
        .map(|g| (g.message_id.clone().unwrap_or_default(), g))
        .collect();
    println!("{stats:?}");
    for (id, g) in &dead {
        println!("dead letter {id}: {:?}", g.headers);
    }
    assert_eq!(
        dead.keys().cloned().collect::<Vec<_>>(),
        vec![
            id("garbage"),
            id("permanent"),
            id("poison"),
            id("wrong-shape")
        ],
        "exactly the bad messages, no valid one"
    );

    let poison = &dead[&id("poison")];
    let h = &poison.headers;
    assert_eq!(poison.body, poison_body.as_bytes(), "original body");
    assert_eq!(h[headers::DEAD_LETTER_REASON], "max_attempts_exceeded");
    assert_eq!(h[headers::HANDLER], "picky");
    assert_eq!(h[headers::KEY], id("poison"));
    assert_eq!(h[headers::ATTEMPTS], "3");
    assert!(h[headers::ERROR].contains("is poison"), "{h:?}");
    assert_eq!(h[headers::ORIGINAL_EXCHANGE], cfg.exchange);
    assert_eq!(h[headers::ORIGINAL_ROUTING_KEY], ROUTING_KEY);
    assert!(
        h[headers::FIRST_FAILURE] < h[headers::LAST_FAILURE],
        "{h:?}"
    );
    if !reconnected {
        assert_eq!(h[headers::ATTEMPT], "3", "it came back twice");
    }
    assert_eq!(h["trace-id"], "t-42", "original headers are kept");

    for name in ["garbage", "wrong-shape"] {
        let g = &dead[&id(name)];
        let h = &g.headers;
        assert_eq!(h[headers::DEAD_LETTER_REASON], "undecodable", "{h:?}");
        assert_eq!(h[headers::ATTEMPTS], "0", "the handler never ran");
        assert!(!h.contains_key(headers::ATTEMPT), "never retried: {h:?}");
        assert_eq!(h[headers::FIRST_FAILURE], h[headers::LAST_FAILURE]);
        assert_eq!(h[headers::ORIGINAL_EXCHANGE], cfg.exchange);
        assert!(!h[headers::ERROR].is_empty());
    }
    assert_eq!(dead[&id("garbage")].body, b"{not json");
    assert_eq!(dead[&id("garbage")].headers["trace-id"], "t-42");
    assert_eq!(
        dead[&id("wrong-shape")].content_type.as_deref(),
        Some("application/json"),
        "original properties are kept"
    );

    let permanent = &dead[&id("permanent")].headers;
    assert_eq!(permanent[headers::DEAD_LETTER_REASON], "permanent_error");
    assert_eq!(permanent[headers::ATTEMPTS], "1");
    assert!(!permanent.contains_key(headers::ATTEMPT));

    if !reconnected {
        assert_eq!(stats.dead_lettered, 4, "{stats:?}");
    }
    assert_eq!(
        stats.retries, 2,
        "only the poison message was retried: {stats:?}"
    );
    assert_eq!(stats.completed, VALID as u64, "{stats:?}");
    assert_eq!(Rabbit::ready(&cfg.queue).await, 0);
    for d in &cfg.retry_delays {
        assert_eq!(Rabbit::ready(&cfg.retry_queue_name(*d)).await, 0);
    }
    Rabbit::delete_topology(&cfg).await;
}

/// The framework's headers (`x-original-*`, `x-first-failure` and the dead-letter ones) in
/// a message as its producer sent it are replaced in its copies: a dead letter, first
/// copied directly or after retries, carries only what the framework wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_supplied_original_headers_are_replaced() {
    init_tracing();
    let pg = PgEnv::new().await;
    let mut cfg = config(&amqp::unique_name("spoof"));
    cfg.exchange = amqp::unique_name("x");
    cfg.binding_keys = vec![ROUTING_KEY.to_owned()];
    let inbox = pg.inbox().await;
    let worker = Worker::with_config(inbox.clone(), picky, worker_config(2)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;

    const FORGED: &str = "1999-01-01T00:00:00.000Z";
    let forged = BTreeMap::from(
        [
            (headers::ORIGINAL_EXCHANGE, "forged-exchange"),
            (headers::ORIGINAL_ROUTING_KEY, "forged.key"),
            (headers::FIRST_FAILURE, FORGED),
            (headers::LAST_FAILURE, FORGED),
            (headers::KEY, "forged-key"),
            (headers::DEAD_LETTER_REASON, "forged"),
            ("trace-id", "t-7"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let id = |name: &str| format!("{}-{name}", cfg.queue);
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    for (name, body) in [
        (
            "permanent",
            json!({"id": id("permanent"), "permanent": true}),
        ),
        ("poison", json!({"id": id("poison"), "poison": true})),
    ] {
        publisher
            .publish(ROUTING_KEY, &id(name), body.to_string().as_bytes(), &forged)
            .await
            .unwrap();
    }
    publisher
        .publish(ROUTING_KEY, &id("garbage"), b"{not json", &forged)
        .await
        .unwrap();
    publisher.close().await;

    let dlq = cfg.dead_letter_queue_name();
    wait_for("3 dead letters", LONG, || async {
        Rabbit::ready(&dlq).await >= 3
    })
    .await;
    running.stop().await;
    let dead: BTreeMap<String, Got> = Rabbit::take_all(&dlq)
        .await
        .into_iter()
        .map(|g| (g.message_id.clone().unwrap_or_default(), g))
        .collect();
    for (name, reason) in [
        ("permanent", "permanent_error"),
        ("poison", "max_attempts_exceeded"),
        ("garbage", "undecodable"),
    ] {
        let h = &dead[&id(name)].headers;
        println!("dead letter {name}: {h:?}");
        assert_eq!(h[headers::ORIGINAL_EXCHANGE], cfg.exchange, "{h:?}");
        assert_eq!(h[headers::ORIGINAL_ROUTING_KEY], ROUTING_KEY, "{h:?}");
        assert_ne!(h[headers::FIRST_FAILURE], FORGED, "{h:?}");
        assert_ne!(h[headers::LAST_FAILURE], FORGED, "{h:?}");
        assert_eq!(h[headers::DEAD_LETTER_REASON], reason, "{h:?}");
        assert_eq!(
            h["trace-id"], "t-7",
            "the producer's other headers are kept"
        );
    }
    // Keys: the derived one where the handler ran, none where the payload did not decode.
    assert_eq!(dead[&id("poison")].headers[headers::KEY], id("poison"));
    assert!(
        !dead[&id("garbage")].headers.contains_key(headers::KEY)
            || dead[&id("garbage")].headers[headers::KEY] != "forged-key",
        "{:?}",
        dead[&id("garbage")].headers
    );
    Rabbit::delete_topology(&cfg).await;
}
