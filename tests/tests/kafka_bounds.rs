//! Bounds on Kafka: at most `WorkerConfig::concurrency` handlers run at once (records of
//! different keys run concurrently with `ProcessingOrder::Key`), and a partition whose
//! records back up behind a slow handler is held back (left unread), so the records the
//! transport holds stay bounded however far the topic runs ahead.
//!
//! What the transport holds per partition is not part of its API; it logs it (at debug
//! level, every 2 s: `tracked=`, `full=`) and logs each hold and read again. The test reads
//! those lines through a tracing layer of its own.

// Test code: it may unwrap and print.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use consumer_kafka::ProcessingOrder;
use consumer_tests::gauge::{gated, Lane};
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context as LayerContext, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

const LONG: Duration = Duration::from_secs(120);

/// The transport's debug lines, each as its message followed by its fields.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Keeps every debug event of `consumer_kafka` in [`LINES`].
struct TransportLog;

struct Line<'a>(&'a mut String);

impl Visit for Line<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for TransportLog {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: LayerContext<'_, S>) {
        let mut line = String::new();
        event.record(&mut Line(&mut line));
        LINES.lock().unwrap().push(line);
    }
}

/// Installs the capturing layer (debug of `consumer_kafka` only) beside the usual test log.
fn init_capture() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let capture = TransportLog.with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target("consumer_kafka", tracing::Level::DEBUG),
        );
        let fmt = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            );
        tracing_subscriber::registry()
            .with(capture)
            .with(fmt)
            .init();
    });
}

/// Captured lines that mention `topic` and contain `needle`.
fn lines(topic: &str, needle: &str) -> Vec<String> {
    LINES
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains(topic) && l.contains(needle))
        .cloned()
        .collect()
}

/// The `tracked=` counts of the transport's summaries of `topic`'s partition 0.
fn tracked(topic: &str) -> Vec<usize> {
    lines(&format!("{topic}/0:"), "tracked=")
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("tracked=")? + "tracked=".len()..];
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

/// The jobs `0..n`, all in `lane`, each with its own Kafka key.
fn jobs(n: usize, lane: &str, work_ms: u64) -> Vec<(String, String, serde_json::Value)> {
    (0..n)
        .map(|i| {
            let id = format!("job-{i}");
            (
                id.clone(),
                id.clone(),
                json!({"id": id, "lane": lane, "work_ms": work_ms}),
            )
        })
        .collect()
}

async fn ledger_rows(env: &KafkaEnv) -> i64 {
    let inbox = env.pg.inbox().await;
    let n = sqlx::query_scalar("SELECT count(DISTINCT job_id) FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    inbox.pool().close().await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handlers_stay_within_concurrency() {
    const JOBS: usize = 60;
    const CONCURRENCY: usize = 3;
    init_capture();
    let env = KafkaEnv::new("kconc", 1).await;
    let lane = Lane::get(&env.topic);
    let ends = publish_all(&env.publisher(), &env.topic, 1, jobs(JOBS, &env.topic, 20)).await;
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    let running = Running::start_handler(&env, gated, config, worker_config(CONCURRENCY)).await;

    // Gate closed: every key may run, the worker's permits are what holds them back.
    wait_for("the handlers busy", LONG, || async {
        lane.running() == CONCURRENCY
    })
    .await;
    assert_eq!(lane.max(), CONCURRENCY);
    lane.open();
    wait_for("every record committed", LONG, || async {
        ledger_rows(&env).await == JOBS as i64 && env.committed_up_to(&ends).await
    })
    .await;
    let stats = running.stop().await;
    println!("max handlers at once: {}; {stats:?}", lane.max());
    assert_eq!(
        lane.max(),
        CONCURRENCY,
        "most handlers ever running at once"
    );
    assert_eq!(lane.runs(), JOBS as u64, "each record ran once");
}

/// The transport takes up to this many records from librdkafka's queue of all partitions
/// between two checks of the limits (`POLL_BATCH` in `consumer-kafka`), so a partition
/// holds at most its limit plus this many records before it is left unread.
const POLL_ROUND: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backed_up_partition_is_held_back_and_holds_a_bounded_number_of_records() {
    // Well over the bound, so that a partition that is never held back exceeds it.
    const JOBS: usize = 1500;
    const LIMIT: usize = 50;
    init_capture();
    let env = KafkaEnv::new("kpause", 1).await;
    let lane = Lane::get(&env.topic);
    let ends = publish_all(&env.publisher(), &env.topic, 1, jobs(JOBS, &env.topic, 0)).await;
    let mut config = env.config();
    config.max_buffered_per_partition = LIMIT;
    let running = Running::start_handler(&env, gated, config, worker_config(4)).await;

    // The first record blocks at the gate; its partition runs in order, so everything
    // fetched behind it waits in the transport until the partition is held back.
    wait_for(
        "the partition held back with its head blocked",
        LONG,
        || async {
            lane.running() == 1
                && !lines(&env.topic, "holding back").is_empty()
                && lines(&format!("{}/0:", env.topic), "full=true").len() >= 2
        },
    )
    .await;
    let held = tracked(&env.topic);
    println!("records held while held back: {held:?}");
    let most = held.iter().copied().max().unwrap_or(0);
    assert!(
        most <= LIMIT + POLL_ROUND,
        "the transport holds {most} records (limit {LIMIT}, one poll round {POLL_ROUND}, topic {JOBS}: more than both)"
    );
    assert_eq!(
        lane.runs(),
        1,
        "in partition order, nothing runs past the blocked head"
    );

    lane.open();
    wait_for("every record committed", LONG, || async {
        ledger_rows(&env).await == JOBS as i64 && env.committed_up_to(&ends).await
    })
    .await;
    let stats = running.stop().await;
    let held = tracked(&env.topic);
    let most = held.iter().copied().max().unwrap_or(0);
    let holds = lines(&env.topic, "holding back").len();
    let reads = lines(&env.topic, "reading again").len();
    println!("held at most {most} records; held back {holds} times, read again {reads}; {stats:?}");
    assert!(most <= LIMIT + POLL_ROUND, "held {most}: {held:?}");
    assert!(
        reads >= 1,
        "the held-back partition was read again as its buffer drained"
    );
    assert_eq!(lane.runs(), JOBS as u64, "each record ran once");
}

/// `max_buffered_per_partition` as its documentation words it: the records a partition
/// buffers before it is left unread. The transport reads a partition's own queue up to the
/// room its buffer has left, so it never takes more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backed_up_partition_holds_no_more_than_its_limit() {
    const JOBS: usize = 600;
    const LIMIT: usize = 50;
    init_capture();
    let env = KafkaEnv::new("kstrict", 1).await;
    let lane = Lane::get(&env.topic);
    let ends = publish_all(&env.publisher(), &env.topic, 1, jobs(JOBS, &env.topic, 0)).await;
    let mut config = env.config();
    config.max_buffered_per_partition = LIMIT;
    let running = Running::start_handler(&env, gated, config, worker_config(4)).await;
    wait_for(
        "the partition held back with its head blocked",
        LONG,
        || async {
            lane.running() == 1 && lines(&format!("{}/0:", env.topic), "full=true").len() >= 2
        },
    )
    .await;
    let held = tracked(&env.topic);
    lane.open();
    wait_for("every record committed", LONG, || async {
        ledger_rows(&env).await == JOBS as i64 && env.committed_up_to(&ends).await
    })
    .await;
    running.stop().await;
    let most = held.iter().copied().max().unwrap_or(0);
    assert!(
        most <= LIMIT,
        "held {most} records with a limit of {LIMIT}: {held:?}"
    );
}
