//! Throughput of the framework next to the floor it cannot beat, in one process run.
//!
//! Run with (PostgreSQL from `scripts/postgres.sh`, fsync and synchronous commit ON):
//!
//! ```text
//! eval "$(scripts/postgres.sh env)"
//! cargo run --release -p bench -- --messages 20000
//! ```
//!
//! Arms, interleaved (every repetition runs every arm once, in turn) over the same number and
//! size of messages:
//!
//! - `db floor, 1/tx`: the inbox insert and the effect insert, one transaction per message,
//!   no broker: what a durable inbox costs per message at best;
//! - `db floor, N/tx`: the same rows, N messages per transaction;
//! - `db floor, N/tx, 1 stmt/msg`: the same, but the effects inserted one statement per
//!   message, as a handler called once per message does: the floor of batched mode;
//! - `db floor, 1/tx + event`, `db floor, N/tx + event`: the floor's rows and one outbox
//!   row a message, with the framework's statement: the handler side of the `+ outbox` arms
//!   at best, before a relay reads, publishes or deletes anything;
//! - `hand-written 1/tx`: a hand-written consumer of the in-memory broker doing the same as
//!   the floor per message, then acking;
//! - `framework 1/tx` and `framework batched`: the runtime on the in-memory broker (batched:
//!   with the handler's batch function, one effect statement per batch);
//!   `framework batched, 1 stmt/msg`: batched mode with a handler that has no batch function,
//!   so it runs once per message in the batch's transaction;
//! - with `AMQP_URL` / `KAFKA_BROKERS` set, the same on RabbitMQ and Kafka, next to the raw
//!   client (`amqp: raw ack each` acks every delivery alone, which prices per-delivery acks
//!   against `amqp: raw consume+ack`'s `multiple` ack every 64);
//! - `amqp: fw 1/tx + outbox`, `amqp: fw batched + outbox` and the same on Kafka: the
//!   framework arm whose handler also writes one event a message through the outbox
//!   (`Context::publish`, `BatchContext::publish`), which a `Relay` on the same database
//!   publishes to a fresh queue or topic of the same broker (`outbox`). The clock stops when
//!   the broker has confirmed the last event, so the rate includes the relay's work; the
//!   report adds their rate up to the last ack and how long after it the last event was
//!   confirmed, and checks that the destination holds every event once. `amqp: relay alone`
//!   and `kafka: relay alone`: the relay by itself, draining an outbox filled with as many
//!   such events before its clock starts (what the relay can publish a second);
//!   `kafka: raw produce`: raw rdkafka producing the same events, every one in flight at
//!   once (what publishing them costs without the outbox).
//!
//! It prints msgs/s, this process's CPU time per message (`CPU µs`), the CPU time of the
//! local PostgreSQL server processes (`PG µs`) and broker processes (`broker`: RabbitMQ's
//! `beam.smp`, Kafka's `java`) per message (all such processes, so other load on the same servers
//! counts too), `all/slot`: the three together over the CPU time the machine's cores had
//! per message at that rate (near 1, the arm is bound by the cores), p50/p99
//! delivery-to-ack latency and the ratios (`report`), each the median over the repetitions
//! (5 by default), rate, CPU and ratios with their spread: `median [min, max]`. A ratio is
//! taken within each repetition, then summarised.
//!
//! `--compare BEFORE_BINARY` makes a before/after pair one command (`compare`): another
//! build of the bench and this one run alternately, one repetition each per round
//! (`--reps` rounds), and are reported side by side. `--compare-metrics` does the same with
//! this build alone, metrics off against on (`--metrics on` installs a Prometheus recorder
//! and renders it every second). `--json PATH` writes a run's figures.
//!
//! Options (`--help` lists them with their defaults): `--messages N --reps N --size BYTES
//! --batch N --concurrency N --prefetch N`; `--arms a,b` runs
//! only the arms whose names contain one of the given strings (e.g. `--arms 'memory: fw'`; a
//! comma followed by a space is part of a name, as in `db floor, 1/tx`),
//! or end in one given with a trailing `$` (`--arms 'kafka: fw batched$'`, that arm alone,
//! handy under a profiler); `--rss-every-ms MS` prints this process's RSS to stderr every MS
//! milliseconds and `--latency 0` stops recording per-delivery latencies (the RSS check:
//! `--messages 1000000 --reps 1 --arms 'amqp: fw batched' --rss-every-ms 10000 --latency 0`);
//! `--relay-batch N` and `--relay-rounds N` set the rows a relay round of the `+ outbox` arms
//! takes and the rounds in progress at once (`RelayConfig`'s defaults: 500 and 2);
//! `--thread-cpu` prints every arm's CPU time a message by thread name.
//!
//! `--http N` runs no arm either: the `Idempotency-Key` layer's cost on a trivial POST,
//! with and without the Redis fast path (`http`).
//!
//! `--outbox-latency N` runs no arm: instead, on each broker, N messages committed one at a
//! time by the application through `Outbox::enqueue` on a pool of its own, so that only
//! PostgreSQL's `LISTEN/NOTIFY` wakes the relay (which polls every 1 s), each timed from the
//! commit to the broker's confirm and to its consumption, printed as p50 / p99 / max
//! (`outbox_latency`).
//! The servers come from `DATABASE_URL`, `AMQP_URL` and `KAFKA_BROKERS` (or `--database-url`,
//! `--amqp-url`, `--kafka-brokers`).
//!
//! The files, by role:
//!
//! - `main.rs`: the command line (`Options`, `--metrics`' recorder) and the run (`measure`:
//!   the database prepared, every arm in turn, then the report);
//! - `arms.rs`: which arms a run keeps (`--arms`);
//! - `postgres.rs`: the work every arm does in PostgreSQL: the bench's message (`Job`) and
//!   handler (`record`), the hand-written consumers' transactions and the `db floor` arms;
//! - `framework.rs`: what every framework arm shares, whatever its broker: its worker, what it
//!   runs (`Fw`), and its figures once it has completed every message;
//! - `memory.rs`, `amqp.rs`, `kafka.rs`: the arms on each broker;
//! - `outbox.rs`: the `+ outbox` arms' handler and the relay beside them;
//! - `measure.rs`: what an arm's figures are measured with: its clock, this process's RSS and
//!   CPU time (by thread with `--thread-cpu`), the local servers' CPU time, the latency
//!   quantiles, `--perf-ctl`;
//! - `timing.rs`: the sampled deliveries' delivery-to-ack latencies;
//! - `report.rs`: the report of a run, and its JSON; `compare.rs`: `--compare` and
//!   `--compare-metrics`;
//! - `http.rs`: `--http`; `outbox_latency.rs`: `--outbox-latency`, and `arrivals.rs`: what
//!   arrives at its consumers (each broker module starts one).

// A benchmark report is this program's output.
#![allow(clippy::print_stdout)]

mod amqp;
mod arms;
mod arrivals;
mod compare;
mod framework;
mod http;
mod kafka;
mod measure;
mod memory;
mod options;
mod outbox;
mod outbox_latency;
mod postgres;
mod relay;
mod report;
mod timing;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use consumer_core::{BatchConfig, Inbox, InboxConfig};
use framework::Fw;
use measure::{rss_kib, Figures, ThreadTimes, PERF_CTL, THREAD_CPU};
use options::{MetricsMode, Options};
use outbox::OutboxArm;
use postgres::{db_floor, record, record_each, reset, Floor, BATCH_WAIT};
use sqlx::postgres::PgPoolOptions;
use timing::RECORD_LATENCY;

/// Installs a Prometheus recorder for the whole process and renders it every second on a
/// thread of its own (a scrape's cost, and the upkeep that drains its histograms).
fn install_recorder() -> anyhow::Result<()> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    std::thread::Builder::new()
        .name("metrics-scrape".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            handle.run_upkeep();
            std::hint::black_box(handle.render());
        })?;
    Ok(())
}

/// Runs the pair of `--compare` or `--compare-metrics`, or else installs the recorder of
/// `--metrics on` and measures on a tokio runtime.
fn main() -> anyhow::Result<()> {
    let o = <Options as clap::Parser>::parse();
    if let Some(before) = &o.compare {
        return compare::run(
            &compare::Side::build(before),
            &compare::Side::this(&[])?,
            o.reps,
        );
    }
    if o.compare_metrics {
        return compare::run(
            &compare::Side::this(&["--metrics", "off"])?,
            &compare::Side::this(&["--metrics", "on"])?,
            o.reps,
        );
    }
    if o.metrics == MetricsMode::On {
        install_recorder()?;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(measure(o))
}

/// Runs every arm `o.reps` times, interleaved, and reports.
async fn measure(o: Options) -> anyhow::Result<()> {
    if let Some(path) = &o.perf_ctl {
        let fifo = std::fs::OpenOptions::new().write(true).open(path)?;
        let _ = PERF_CTL.set(Mutex::new(fifo));
    }
    RECORD_LATENCY.store(o.latency != 0, std::sync::atomic::Ordering::Relaxed);
    if o.thread_cpu {
        if let Ok(mut t) = THREAD_CPU.lock() {
            *t = Some(ThreadTimes::default());
        }
    }
    // Warnings of the runtime and the transports (a lost channel, a database error) explain
    // a failed arm; RUST_LOG=... for more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = o.database_url.clone();
    // The handlers' connections, a relay's rounds, its LISTEN and two more.
    let rounds = o.relay_config().rounds as usize;
    let connections = u32::try_from(o.concurrency + rounds + 3).unwrap_or(16);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect(&url)
        .await?;
    sqlx::raw_sql(
        "DROP SCHEMA IF EXISTS bench CASCADE; CREATE SCHEMA bench;
         SET search_path = bench;",
    )
    .execute(&pool)
    .await?;
    pool.close().await;
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .options([("search_path", "bench")]);
    // Every connection is opened here, before any clock starts, and kept for the whole run:
    // the handshakes (SCRAM's key derivation, a few ms of this process's CPU for a pool's
    // worth) would otherwise land in whichever arm first needs one more connection.
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options.clone())
        .await?;
    let opened = futures::future::try_join_all((0..connections).map(|_| pool.acquire())).await?;
    drop(opened);
    let inbox = Inbox::new(pool.clone(), InboxConfig::in_schema("bench")).await?;
    sqlx::raw_sql(
        "CREATE TABLE effects (job_id BIGINT NOT NULL, body TEXT NOT NULL);
         CREATE TABLE floor_inbox (LIKE consumer_inbox INCLUDING ALL);",
    )
    .execute(&pool)
    .await?;
    let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(&pool).await?;
    let sync_commit: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await?;
    if o.outbox_latency > 0 {
        let server = format!("PostgreSQL fsync={fsync} synchronous_commit={sync_commit}");
        return outbox_latency::run(&inbox, options, &o, &server).await;
    }
    if o.http > 0 {
        let server = format!("PostgreSQL fsync={fsync} synchronous_commit={sync_commit}");
        return http::run(&pool, &o, o.http, &server).await;
    }

    let batched = Some(BatchConfig::new(o.batch, BATCH_WAIT));
    let amqp_url = o.amqp_url.clone();
    let mut arms = vec![
        "db floor, 1/tx",
        "db floor, N/tx",
        "db floor, N/tx, 1 stmt/msg",
        "db floor, 1/tx + event",
        "db floor, N/tx + event",
        "memory: hand 1/tx",
        "memory: fw 1/tx",
        "memory: fw batched",
        "memory: fw batched, 1 stmt/msg",
    ];
    if amqp_url.is_some() {
        arms.extend([
            "amqp: raw consume+ack",
            "amqp: raw ack each",
            "amqp: hand 1/tx",
            "amqp: hand batched",
            "amqp: fw 1/tx",
            "amqp: fw batched",
            "amqp: fw 1/tx + outbox",
            "amqp: fw batched + outbox",
            "amqp: relay alone",
        ]);
    } else {
        eprintln!("AMQP_URL is not set: skipping the RabbitMQ arms");
    }
    let kafka_brokers = o.kafka_brokers.clone();
    if kafka_brokers.is_some() {
        arms.extend([
            "kafka: raw consume+store",
            "kafka: hand 1/tx",
            "kafka: hand batched",
            "kafka: fw transport only",
            "kafka: fw 1/tx",
            "kafka: fw batched",
            "kafka: fw 1/tx + outbox",
            "kafka: fw batched + outbox",
            "kafka: relay alone",
            "kafka: raw produce",
        ]);
    } else {
        eprintln!("KAFKA_BROKERS is not set: skipping the Kafka arms");
    }
    if let Some(filter) = &o.arms {
        arms.retain(|arm| filter.keeps(arm));
    }
    if o.rss_every_ms > 0 {
        // A flat line here over a long run is the "RSS stays flat" check.
        let every = Duration::from_millis(o.rss_every_ms);
        let t0 = Instant::now();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                eprintln!(
                    "rss t={:>7.1}s {:>8} KiB",
                    t0.elapsed().as_secs_f64(),
                    rss_kib()
                );
            }
        });
    }
    let queue = format!("bench_{}", std::process::id());
    let mut results: BTreeMap<&str, Vec<Figures>> = BTreeMap::new();
    let mut first = 0u64;
    for rep in 0..o.reps {
        for (index, &arm) in arms.iter().enumerate() {
            reset(&pool).await?;
            // The `relay alone` arms consume nothing.
            let consumes = !arm.ends_with("relay alone") && !arm.ends_with("raw produce");
            if arm.starts_with("amqp") && consumes {
                amqp::fill(amqp_url.as_deref().unwrap_or_default(), &queue, first, &o).await?;
            }
            let url = amqp_url.as_deref().unwrap_or_default();
            let brokers = kafka_brokers.as_deref().unwrap_or_default();
            // A fresh topic and group per Kafka arm and repetition (by the arm's place in the
            // list: two arms' names may have the same length).
            let topic = format!("{queue}_{rep}_{index}");
            let group = format!("{topic}_g");
            if arm.starts_with("kafka") && consumes {
                kafka::fill(brokers, &topic, first, &o).await?;
            }
            let f = match arm {
                "db floor, 1/tx" => db_floor(&pool, first, &o, Floor::new(1)).await?,
                "db floor, N/tx" => db_floor(&pool, first, &o, Floor::new(o.batch)).await?,
                "db floor, N/tx, 1 stmt/msg" => {
                    db_floor(
                        &pool,
                        first,
                        &o,
                        Floor::new(o.batch).statement_per_message(),
                    )
                    .await?
                }
                "db floor, 1/tx + event" => {
                    db_floor(&pool, first, &o, Floor::new(1).with_event()).await?
                }
                "db floor, N/tx + event" => {
                    db_floor(&pool, first, &o, Floor::new(o.batch).with_event()).await?
                }
                "memory: hand 1/tx" => memory::hand_written(&pool, first, &o).await?,
                "memory: fw 1/tx" => memory::framework(&inbox, record, first, &o, None).await?,
                "memory: fw batched" => {
                    memory::framework(&inbox, record, first, &o, batched).await?
                }
                "memory: fw batched, 1 stmt/msg" => {
                    memory::framework(&inbox, record_each, first, &o, batched).await?
                }
                "amqp: raw consume+ack" => amqp::raw(url, &queue, &o, false).await?,
                "amqp: raw ack each" => amqp::raw(url, &queue, &o, true).await?,
                "amqp: hand 1/tx" => amqp::hand_written(url, &queue, &pool, &o).await?,
                "amqp: hand batched" => amqp::hand_batched(url, &queue, &pool, &o).await?,
                "amqp: fw 1/tx" => {
                    amqp::framework(url, &queue, &inbox, &o, Fw::alone(record, None)).await?
                }
                "amqp: fw batched" => {
                    amqp::framework(url, &queue, &inbox, &o, Fw::alone(record, batched)).await?
                }
                "amqp: fw 1/tx + outbox" => {
                    amqp::outbox(url, &queue, &inbox, &o, OutboxArm::Framework(None)).await?
                }
                "amqp: fw batched + outbox" => {
                    amqp::outbox(url, &queue, &inbox, &o, OutboxArm::Framework(batched)).await?
                }
                "amqp: relay alone" => {
                    amqp::outbox(url, &queue, &inbox, &o, OutboxArm::RelayAlone).await?
                }
                "kafka: raw consume+store" => kafka::raw(brokers, &topic, &group, &o).await?,
                "kafka: fw transport only" => {
                    kafka::transport_only(brokers, &topic, &group, &o).await?
                }
                "kafka: hand 1/tx" => {
                    kafka::hand_written(brokers, &topic, &group, &pool, &o, false).await?
                }
                "kafka: hand batched" => {
                    kafka::hand_written(brokers, &topic, &group, &pool, &o, true).await?
                }
                "kafka: fw 1/tx" => {
                    let fw = Fw::alone(record, None);
                    kafka::framework(brokers, &topic, &group, &inbox, &o, fw).await?
                }
                "kafka: fw 1/tx + outbox" => {
                    let arm = OutboxArm::Framework(None);
                    kafka::outbox(brokers, &topic, &group, &inbox, &o, arm).await?
                }
                "kafka: fw batched + outbox" => {
                    let arm = OutboxArm::Framework(batched);
                    kafka::outbox(brokers, &topic, &group, &inbox, &o, arm).await?
                }
                "kafka: raw produce" => kafka::raw_produce(brokers, &topic, &o).await?,
                "kafka: relay alone" => {
                    let arm = OutboxArm::RelayAlone;
                    kafka::outbox(brokers, &topic, &group, &inbox, &o, arm).await?
                }
                _ => {
                    let fw = Fw::alone(record, batched);
                    kafka::framework(brokers, &topic, &group, &inbox, &o, fw).await?
                }
            };
            eprintln!("rep {rep} {arm:<26} {:>9.0} msg/s", f.rate);
            results.entry(arm).or_default().push(f);
            first += o.messages as u64;
        }
    }

    println!(
        "\n{} messages of {} B payload, {} repetitions (median [min, max]), concurrency {}, batch {}; PostgreSQL fsync={fsync} synchronous_commit={sync_commit}\n",
        o.messages, o.size, o.reps, o.concurrency, o.batch
    );
    let run = report::Run {
        arms: arms.iter().map(|a| (*a).to_owned()).collect(),
        figures: results
            .into_iter()
            .map(|(arm, f)| (arm.to_owned(), f))
            .collect(),
    };
    run.print(std::thread::available_parallelism().map_or(1, usize::from));
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_string(&run)?)?;
    }
    Ok(())
}
