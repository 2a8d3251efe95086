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
//!   such events before its clock starts (what the relay can publish a second).
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

// A benchmark report is this program's output.
#![allow(clippy::print_stdout)]

mod amqp;
mod arms;
mod compare;
mod http;
mod kafka;
mod outbox;
mod outbox_latency;
mod report;
mod timing;

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arms::ArmFilter;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{
    handler, BatchConfig, BatchContext, Context, Handler, HandlerError, Inbox, InboxConfig,
    Settlement, Worker, WorkerConfig,
};
use futures::StreamExt;
use outbox::OutboxArm;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use timing::{timed, Acks, RECORD_LATENCY};

#[derive(Debug, Deserialize)]
struct Job {
    id: u64,
    body: String,
}

/// The bench's handler: one effect row per job. In batched mode its batch function writes a
/// batch's rows with one statement.
#[handler(name = "bench", retention = "1h", batch = "record_batch")]
async fn record(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
        .bind(i64::try_from(job.id).unwrap_or(i64::MAX))
        .bind(&job.body)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// `record`'s batch function: the same rows, one `INSERT ... SELECT FROM unnest` a batch.
async fn record_batch(
    ctx: &mut BatchContext<'_, Postgres>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, bodies): (Vec<i64>, Vec<String>) = jobs
        .into_iter()
        .map(|j| (i64::try_from(j.id).unwrap_or(i64::MAX), j.body))
        .unzip();
    sqlx::query(
        "INSERT INTO effects (job_id, body) SELECT * FROM unnest($1::bigint[], $2::text[])",
    )
    .bind(ids)
    .bind(bodies)
    .execute(ctx.db())
    .await?;
    Ok(())
}

/// `record` without a batch function: batched mode then calls it once per message, in the
/// batch's transaction.
#[handler(name = "bench", retention = "1h")]
async fn record_each(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    record::call(ctx, job).await
}

/// The batch window of the batched arms (framework and hand-written alike).
const BATCH_WAIT: Duration = Duration::from_millis(5);

/// Whether a metrics recorder is installed (`--metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum MetricsMode {
    /// No recorder: the framework's metrics are no-ops.
    Off,
    /// A Prometheus recorder, rendered every second.
    On,
}

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

/// The command line, parsed by clap (`--help` lists it).
#[derive(Debug, clap::Parser)]
#[command(
    name = "bench",
    about = "Throughput of the framework next to raw clients and the database floor, \
             interleaved arms in one process (BENCHMARKS.md describes them)."
)]
struct Options {
    /// Messages per arm and repetition.
    #[arg(long, default_value_t = 10_000)]
    messages: usize,
    /// Repetitions; every repetition runs every arm once, in turn, and the report shows
    /// the medians and their spread. With `--compare`: the rounds.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Compare with another build of the bench (the "before", e.g. built from an earlier
    /// commit): it and this binary run alternately, one repetition each per round, with
    /// the other arguments given here, and both are reported side by side.
    #[arg(long, value_name = "BEFORE_BINARY", conflicts_with = "compare_metrics")]
    compare: Option<std::path::PathBuf>,
    /// A pair of this binary with `--metrics off` (before) and `--metrics on` (after),
    /// alternating as `--compare` does: what exporting the metrics costs.
    #[arg(long)]
    compare_metrics: bool,
    /// `on`: a Prometheus recorder is installed before the arms run (as in a worker that
    /// serves `/metrics`) and its text rendered every second, as a scrape would; `off`: no
    /// recorder, so every metric the framework records is a no-op.
    #[arg(long, value_enum, default_value = "off")]
    metrics: MetricsMode,
    /// Also write every repetition's figures to this file as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<std::path::PathBuf>,
    /// Payload size in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 256)]
    size: usize,
    /// Messages per transaction in the batched arms (framework and hand-written).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Partitions of the topic the Kafka arms consume (its records spread over them by key).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(i32).range(1..))]
    partitions: i32,
    /// Records each partition of the framework's Kafka arms buffers at most
    /// (`KafkaConfig::max_buffered_per_partition`); the transport's default if not given.
    #[arg(long, value_name = "RECORDS")]
    kafka_max_buffered: Option<std::num::NonZeroUsize>,
    /// Handlers (or hand-written transactions) running at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// RabbitMQ prefetch (unacked deliveries the broker hands out at once).
    #[arg(long, default_value_t = 256)]
    prefetch: u16,
    /// Only the arms whose name contains one of these strings (e.g. `--arms 'memory: fw'`),
    /// or, for one ending in `$`, ends in the rest (`--arms 'kafka: fw batched$'`); every
    /// arm if not given.
    /// A comma followed by a space is part of a name (`--arms 'db floor, 1/tx$,memory: fw'`).
    #[arg(long, value_name = "NAME[,NAME...]", value_parser = ArmFilter::parse)]
    arms: Option<ArmFilter>,
    /// Print this process's RSS to stderr every this many milliseconds (0: never).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    rss_every_ms: u64,
    /// A perf control FIFO (`perf record --control fifo:PATH -D -1`): `enable` is written to
    /// it when an arm's clock starts and `disable` when it stops, so a profile holds the
    /// arms alone, not the filling of their queues.
    #[arg(long, value_name = "FIFO")]
    perf_ctl: Option<std::path::PathBuf>,
    /// Print to stderr, for every arm, this process's CPU time per message by thread name
    /// (from /proc/self/task, to the nanosecond): which threads an arm's CPU goes to.
    #[arg(long)]
    thread_cpu: bool,
    /// Record per-delivery latencies (1) or not (0, for long RSS runs).
    #[arg(long, value_name = "0|1", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    latency: u8,
    /// Rows a relay round takes in the `+ outbox` arms (`RelayConfig::batch`; its default
    /// unless given).
    #[arg(long, value_name = "N")]
    relay_batch: Option<u32>,
    /// Relay rounds in progress at once in the `+ outbox` arms (`RelayConfig::rounds`; its
    /// default unless given).
    #[arg(long, value_name = "N")]
    relay_rounds: Option<u32>,
    /// Instead of the arms: this many samples, on each broker, of the time from the commit of
    /// a message the application wrote to the outbox (on a pool of its own, so only
    /// PostgreSQL's NOTIFY wakes the relay) to the broker's confirm and to its consumption,
    /// the relay polling every 1 s (0: the arms run).
    #[arg(long, value_name = "SAMPLES", default_value_t = 0,
          conflicts_with_all = ["compare", "compare_metrics"])]
    outbox_latency: usize,
    /// Instead of the arms: the `Idempotency-Key` layer's cost on a trivial POST, this many
    /// requests a case (no layer; PostgreSQL store, first requests and replays; the same
    /// with the Redis fast path of `REDIS_URL`), `--reps` times (0: the arms run).
    #[arg(long, value_name = "REQUESTS", default_value_t = 0,
          conflicts_with_all = ["compare", "compare_metrics", "outbox_latency"])]
    http: usize,
    /// The PostgreSQL to measure (`eval "$(scripts/postgres.sh env)"` sets it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// RabbitMQ for the `amqp:` arms; they are skipped without it.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: Option<String>,
    /// Kafka bootstrap servers for the `kafka:` arms; they are skipped without it.
    #[arg(long, env = "KAFKA_BROKERS")]
    kafka_brokers: Option<String>,
}

impl Options {
    /// The relay of the `+ outbox` arms: the defaults (a poll every 1 s), `--relay-batch`,
    /// `--relay-rounds`.
    fn relay_config(&self) -> consumer_core::RelayConfig {
        let mut config = consumer_core::RelayConfig::default();
        if let Some(batch) = self.relay_batch {
            config = config.with_batch(batch);
        }
        if let Some(rounds) = self.relay_rounds {
            config = config.with_rounds(rounds);
        }
        config
    }
}

/// One arm's figures from one repetition.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Figures {
    rate: f64,
    cpu_us_per_msg: f64,
    p50_ms: f64,
    p99_ms: f64,
    rss_mib: f64,
    /// CPU time of the PostgreSQL server processes per message (all of them: backends,
    /// WAL writer, checkpointer), if readable.
    server_us_per_msg: f64,
    /// CPU time of the broker processes (RabbitMQ's `beam.smp`, Kafka's `java`) per message.
    broker_us_per_msg: f64,
    measured_latency: bool,
    /// The `+ outbox` arms': how fast they consumed, and how long the relay took after.
    #[serde(default)]
    relay: Option<outbox::RelayFigures>,
}

/// `--thread-cpu`: every live thread's CPU time when the running arm's clock started and when
/// its CPU time was read ([`cpu_since`]); `None` without the flag.
static THREAD_CPU: Mutex<Option<ThreadTimes>> = Mutex::new(None);

/// The two readings of the threads' CPU time of one arm (see [`THREAD_CPU`]).
#[derive(Default)]
struct ThreadTimes {
    start: Vec<ThreadTime>,
    end: Vec<ThreadTime>,
}

/// One thread of this process: its id, name, and CPU time in nanoseconds.
struct ThreadTime {
    id: u64,
    name: String,
    ns: u64,
}

/// Every live thread of this process (its CPU time is the first field of its schedstat).
fn threads_cpu() -> Vec<ThreadTime> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let id = dir.file_name()?.to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            let ns = std::fs::read_to_string(dir.join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some(ThreadTime {
                id,
                name: name.trim().to_owned(),
                ns,
            })
        })
        .collect()
}

/// With `--thread-cpu`, `f` applied to the running arm's readings; `None` without the flag.
fn with_thread_times<R>(f: impl FnOnce(&mut ThreadTimes) -> R) -> Option<R> {
    THREAD_CPU
        .lock()
        .ok()
        .as_deref_mut()
        .and_then(Option::as_mut)
        .map(f)
}

/// With `--thread-cpu`, reads every thread's CPU time into the running arm's `start` or `end`.
fn read_threads_cpu(into: fn(&mut ThreadTimes) -> &mut Vec<ThreadTime>) {
    with_thread_times(|times| *into(times) = threads_cpu());
}

/// This process's CPU time since `cpu0`, read when an arm's clock stops; with
/// `--thread-cpu`, every thread's is read at the same moment.
fn cpu_since(cpu0: Duration) -> Duration {
    let cpu = cpu_time() - cpu0;
    read_threads_cpu(|t| &mut t.end);
    cpu
}

/// `--thread-cpu`: prints the running arm's CPU time per message (of `n`) by thread name,
/// from its clock's start to the reading of its CPU time; threads that ended meanwhile are
/// not seen (the arm's `CPU µs` holds them).
fn print_threads_cpu(n: usize) {
    let Some(times) = with_thread_times(std::mem::take) else {
        return;
    };
    let mut by_name: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in times.end {
        let was = times
            .start
            .iter()
            .find(|s| s.id == t.id)
            .map_or(0, |s| s.ns);
        let e = by_name.entry(t.name).or_default();
        e.0 += 1;
        e.1 += t.ns.saturating_sub(was);
    }
    let line: Vec<String> = by_name
        .iter()
        .filter(|(_, (_, ns))| *ns > 0)
        .map(|(name, (k, ns))| format!("{name} x{k} {:.2}", *ns as f64 / 1e3 / n as f64))
        .collect();
    eprintln!("threads, CPU µs a message: {}", line.join(", "));
}

/// Resident set size of this process (VmRSS) in KiB, to show memory stays bounded.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or_default()
}

/// What an arm's figures other than its clocks are measured from, read when it starts and
/// again when it stops: this process's RSS and the local servers' CPU time.
#[derive(Debug, Clone, Copy)]
struct Baseline {
    rss_kib: u64,
    servers: ServersCpu,
}

impl Baseline {
    fn now() -> Self {
        Baseline {
            rss_kib: rss_kib(),
            servers: ServersCpu::now(),
        }
    }
}

/// An arm's clock: its wall time and this process's CPU time from the moment it starts, and
/// the [`Baseline`] it started at. Every arm starts one just before its first message is
/// handled.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    cpu0: Duration,
    base: Baseline,
}

impl Clock {
    /// Does the bench's own bookkeeping (the [`Baseline`], whose servers' CPU time is read
    /// from every process's /proc entry, a few ms; `--thread-cpu`'s readings) and then starts
    /// the clocks, so that none of it is counted in the arm's figures.
    fn start() -> Self {
        let base = Baseline::now();
        read_threads_cpu(|t| &mut t.start);
        perf_control("enable");
        let cpu0 = cpu_time();
        Clock {
            start: Instant::now(),
            cpu0,
            base,
        }
    }

    /// The arm's figures (see [`figures`]), with both clocks stopped now.
    fn figures(&self, n: usize, latencies: &mut [u64]) -> Figures {
        self.stop().figures(n, latencies)
    }

    /// Stops both clocks, for an arm with more to check before its figures.
    fn stop(&self) -> Stopped {
        let wall = self.start.elapsed();
        Stopped {
            wall,
            cpu: self.cpu(),
            base: self.base,
        }
    }

    /// This process's CPU time since the clock started (see [`cpu_since`]).
    fn cpu(&self) -> Duration {
        cpu_since(self.cpu0)
    }
}

/// An arm's clocks, stopped (see [`Clock::stop`]).
#[derive(Debug, Clone, Copy)]
struct Stopped {
    wall: Duration,
    cpu: Duration,
    base: Baseline,
}

impl Stopped {
    /// The arm's figures (see [`figures`]).
    fn figures(self, n: usize, latencies: &mut [u64]) -> Figures {
        figures(n, self.wall, self.cpu, latencies, self.base)
    }
}

/// This process's CPU time, every thread's (the process CPU-time clock, to the nanosecond;
/// /proc/self/stat's 10 ms ticks if that clock cannot be read).
fn cpu_time() -> Duration {
    if let Ok(t) = cpu_time::ProcessTime::try_now() {
        return t.as_duration();
    }
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            // Fields 14 and 15 (utime, stime) are the 12th and 13th after the comm field.
            Some(after.get(11)?.parse::<u64>().ok()? + after.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or_default();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// User + system CPU time of the local servers' processes, from /proc (zero where not
/// readable): PostgreSQL's (the benchmark's database is local), and the brokers' (RabbitMQ
/// runs in `beam.smp`; Kafka in `java`), every such process on this machine, so another broker node
/// running beside the bench is counted too.
#[derive(Debug, Clone, Copy)]
struct ServersCpu {
    postgres: Duration,
    brokers: Duration,
}

impl ServersCpu {
    /// Reads every process's `stat` once.
    fn now() -> Self {
        let (mut postgres, mut brokers) = (0u64, 0u64);
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                    continue;
                };
                let Some((head, tail)) = stat.rsplit_once(')') else {
                    continue;
                };
                let Some((_, comm)) = head.rsplit_once('(') else {
                    continue;
                };
                let sum = match comm {
                    "postgres" => &mut postgres,
                    "beam.smp" | "java" => &mut brokers,
                    _ => continue,
                };
                let f: Vec<&str> = tail.split_whitespace().collect();
                let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                *sum += get(11) + get(12);
            }
        }
        // USER_HZ is 100 on Linux.
        ServersCpu {
            postgres: Duration::from_millis(postgres * 10),
            brokers: Duration::from_millis(brokers * 10),
        }
    }
}

/// CPU time per message of `n` messages from `start` to `end`.
fn per_msg(start: Duration, end: Duration, n: usize) -> f64 {
    end.saturating_sub(start).as_secs_f64() * 1e6 / n as f64
}

/// A framework arm's figures once its clock has stopped at `end`, after `cpu` of this
/// process's CPU: the worker (its counters `s`) must have completed every message.
fn framework_figures(
    o: &Options,
    s: &consumer_core::StatsSnapshot,
    end: &outbox::End,
    cpu: Duration,
    acks: &Acks,
    base: Baseline,
) -> anyhow::Result<Figures> {
    ensure_completed(o, s)?;
    Ok(end.figures(figures(
        o.messages,
        end.wall,
        cpu,
        &mut acks.latencies(),
        base,
    )))
}

/// Fails unless the worker (its counters `s`) completed every message of the arm.
fn ensure_completed(o: &Options, s: &consumer_core::StatsSnapshot) -> anyhow::Result<()> {
    anyhow::ensure!(
        s.completed == o.messages as u64,
        "framework arm completed {} of {}: {s:?}",
        s.completed,
        o.messages
    );
    Ok(())
}

/// The `--perf-ctl` FIFO, opened once at start.
static PERF_CTL: OnceLock<Mutex<std::fs::File>> = OnceLock::new();

/// Writes `command` to the `--perf-ctl` FIFO, if there is one.
fn perf_control(command: &str) {
    if let Some(ctl) = PERF_CTL.get() {
        if let Ok(mut f) = ctl.lock() {
            let _ = std::io::Write::write_all(&mut *f, format!("{command}\n").as_bytes());
        }
    }
}

/// An arm's figures, taken when its clock stops (which also stops a `--perf-ctl` profile).
fn figures(
    n: usize,
    wall: Duration,
    cpu: Duration,
    latencies: &mut [u64],
    base: Baseline,
) -> Figures {
    perf_control("disable");
    let now = Baseline::now();
    print_threads_cpu(n);
    latencies.sort_unstable();
    let pct = |p: f64| percentile_ms(latencies, p);
    Figures {
        rate: n as f64 / wall.as_secs_f64(),
        cpu_us_per_msg: cpu.as_secs_f64() * 1e6 / n as f64,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        rss_mib: now.rss_kib.saturating_sub(base.rss_kib) as f64 / 1024.0,
        server_us_per_msg: per_msg(base.servers.postgres, now.servers.postgres, n),
        broker_us_per_msg: per_msg(base.servers.brokers, now.servers.brokers, n),
        measured_latency: !latencies.is_empty(),
        relay: None,
    }
}

/// The `p` quantile (0 to 1) of `sorted` microseconds, in milliseconds; 0 for none.
fn percentile_ms(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn payload(id: u64, size: usize) -> String {
    serde_json::json!({"id": id, "body": "x".repeat(size)}).to_string()
}

fn fill(broker: &MemoryBroker, queue: &str, first: u64, o: &Options) {
    for id in first..first + o.messages as u64 {
        broker.publish(
            queue,
            Message {
                id: Some(format!("m-{id}")),
                payload: payload(id, o.size).into(),
                ..Message::default()
            },
        );
    }
}

async fn reset(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "TRUNCATE effects; TRUNCATE floor_inbox; TRUNCATE consumer_inbox; \
         TRUNCATE consumer_inbox_outbox;",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The floor: inbox insert plus effect insert per message, `per_tx` messages a transaction.
/// With `effect_per_message`, the effects are inserted one statement per message (as a
/// handler called once per message does), the inbox rows still with one statement.
async fn db_floor(
    pool: &PgPool,
    first: u64,
    o: &Options,
    per_tx: usize,
    effect_per_message: bool,
) -> anyhow::Result<Figures> {
    let clock = Clock::start();
    let ids: Vec<u64> = (first..first + o.messages as u64).collect();
    let body = "x".repeat(o.size);
    // The same concurrency as the framework arms, so neither side is starved of connections.
    let chunks: Vec<Vec<u64>> = ids.chunks(per_tx).map(<[u64]>::to_vec).collect();
    let work = futures::stream::iter(chunks).map(|chunk| {
        let pool = pool.clone();
        let body = body.clone();
        async move {
            let mut tx = pool.begin().await?;
            let keys: Vec<String> = chunk.iter().map(|id| format!("m-{id}")).collect();
            let job_ids: Vec<i64> = chunk.iter().map(|id| *id as i64).collect();
            sqlx::query(
                "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
                 SELECT 'bench', k, 'h', 'completed', 1 FROM unnest($1::text[]) AS k \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&keys)
            .execute(&mut *tx)
            .await?;
            if effect_per_message {
                for id in &job_ids {
                    sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
                        .bind(id)
                        .bind(&body)
                        .execute(&mut *tx)
                        .await?;
                }
            } else {
                sqlx::query(
                    "INSERT INTO effects (job_id, body) SELECT j, $2 FROM unnest($1::bigint[]) AS j",
                )
                .bind(&job_ids)
                .bind(&body)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = work.buffer_unordered(o.concurrency).collect().await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    Ok(clock.figures(o.messages, &mut []))
}

/// A hand-written per-message consumer's transaction: claims `key` in the inbox and, if it
/// was not claimed before, writes the message's effect; commits.
pub(crate) async fn hand_one(pool: &PgPool, key: &str, job: &Job) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(
        "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
         VALUES ('bench', $1, 'h', 'completed', 1) ON CONFLICT DO NOTHING",
    )
    .bind(key)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if fresh {
        sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
            .bind(job.id as i64)
            .bind(&job.body)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A hand-written batched consumer's transaction: claims the batch's keys with one inbox
/// insert, writes the effects of the keys it claimed with one insert, commits.
async fn hand_batch(pool: &PgPool, batch: Vec<(String, Job)>) -> anyhow::Result<()> {
    let keys: Vec<&str> = batch.iter().map(|(k, _)| k.as_str()).collect();
    let mut tx = pool.begin().await?;
    let claimed: std::collections::HashSet<String> = sqlx::query_scalar(
        "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
         SELECT 'bench', k, 'h', 'completed', 1 FROM unnest($1::text[]) AS k \
         ON CONFLICT DO NOTHING RETURNING key",
    )
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    let (ids, bodies): (Vec<i64>, Vec<&str>) = batch
        .iter()
        .filter(|(k, _)| claimed.contains(k))
        .map(|(_, j)| (j.id as i64, j.body.as_str()))
        .unzip();
    sqlx::query(
        "INSERT INTO effects (job_id, body) SELECT * FROM unnest($1::bigint[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// A hand-written consumer of the in-memory broker: one transaction per message, then ack.
async fn hand_written(pool: &PgPool, first: u64, o: &Options) -> anyhow::Result<Figures> {
    let broker = MemoryBroker::new();
    fill(&broker, "q", first, o);
    let acks = Acks::new(o.messages);
    let clock = Clock::start();
    let consumer = broker.consume("q").take(o.messages);
    let work = consumer.map(|incoming| {
        let pool = pool.clone();
        let acks = acks.clone();
        async move {
            let incoming = timed(incoming?, &acks);
            let job: Job = serde_json::from_slice(&incoming.delivery.payload)?;
            let key = incoming.delivery.message_id.as_deref().unwrap_or_default();
            hand_one(&pool, key, &job).await?;
            incoming.acker.settle(Settlement::Ack).await?;
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = work.buffer_unordered(o.concurrency).collect().await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    let stopped = clock.stop();
    Ok(stopped.figures(o.messages, &mut acks.latencies()))
}

/// The framework's worker for the `record` handler, as every framework arm runs it: the
/// bench's concurrency, `batch`, no retention task.
fn bench_worker<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    o: &Options,
    batch: Option<BatchConfig>,
) -> anyhow::Result<Worker<Postgres, H>> {
    Ok(Worker::with_config(
        inbox.clone(),
        handler,
        WorkerConfig::default()
            .with_concurrency(o.concurrency)
            .with_retention_interval(None)
            .with_batch(batch),
    )?)
}

/// A framework arm on a broker: its handler, batched or not, and for an `+ outbox` arm the
/// relay whose last publish stops the arm's clock.
pub(crate) struct Fw<'a, H> {
    pub(crate) handler: H,
    pub(crate) batch: Option<BatchConfig>,
    pub(crate) relay: Option<&'a outbox::Relaying>,
}

impl<H> Fw<'static, H> {
    /// The framework without an outbox.
    fn alone(handler: H, batch: Option<BatchConfig>) -> Self {
        Fw {
            handler,
            batch,
            relay: None,
        }
    }
}

/// The framework on the in-memory broker.
async fn framework<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    first: u64,
    o: &Options,
    batch: Option<BatchConfig>,
) -> anyhow::Result<Figures> {
    let broker = MemoryBroker::new();
    fill(&broker, "q", first, o);
    let acks = Acks::new(o.messages);
    let worker = bench_worker(inbox, handler, o, batch)?;
    let clock = Clock::start();
    let a2 = acks.clone();
    let consumer = broker.consume("q").map(move |r| r.map(|i| timed(i, &a2)));
    worker.run(consumer, broker.drained("q")).await?;
    let stopped = clock.stop();
    ensure_completed(o, &worker.snapshot())?;
    Ok(stopped.figures(o.messages, &mut acks.latencies()))
}

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
            let consumes = !arm.ends_with("relay alone");
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
                "db floor, 1/tx" => db_floor(&pool, first, &o, 1, false).await?,
                "db floor, N/tx" => db_floor(&pool, first, &o, o.batch, false).await?,
                "db floor, N/tx, 1 stmt/msg" => db_floor(&pool, first, &o, o.batch, true).await?,
                "memory: hand 1/tx" => hand_written(&pool, first, &o).await?,
                "memory: fw 1/tx" => framework(&inbox, record, first, &o, None).await?,
                "memory: fw batched" => framework(&inbox, record, first, &o, batched).await?,
                "memory: fw batched, 1 stmt/msg" => {
                    framework(&inbox, record_each, first, &o, batched).await?
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
