//! The bench's command line ([`Options`], parsed by clap; `--help` lists it) and what it
//! derives from it for the arms (the relay's configuration).

use crate::arms::ArmFilter;

/// Whether a metrics recorder is installed (`--metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum MetricsMode {
    /// No recorder: the framework's metrics are no-ops.
    Off,
    /// A Prometheus recorder, rendered every second.
    On,
}

/// The command line, parsed by clap (`--help` lists it).
#[derive(Debug, clap::Parser)]
#[command(
    name = "bench",
    about = "Throughput of the framework next to raw clients and the database floor, \
             interleaved arms in one process (BENCHMARKS.md describes them)."
)]
pub(crate) struct Options {
    /// Messages per arm and repetition.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) messages: usize,
    /// Repetitions; every repetition runs every arm once, in turn, and the report shows
    /// the medians and their spread. With `--compare`: the rounds.
    #[arg(long, default_value_t = 5)]
    pub(crate) reps: usize,
    /// Compare with another build of the bench (the "before", e.g. built from an earlier
    /// commit): it and this binary run alternately, one repetition each per round, with
    /// the other arguments given here, and both are reported side by side.
    #[arg(long, value_name = "BEFORE_BINARY", conflicts_with = "compare_metrics")]
    pub(crate) compare: Option<std::path::PathBuf>,
    /// A pair of this binary with `--metrics off` (before) and `--metrics on` (after),
    /// alternating as `--compare` does: what exporting the metrics costs.
    #[arg(long)]
    pub(crate) compare_metrics: bool,
    /// `on`: a Prometheus recorder is installed before the arms run (as in a worker that
    /// serves `/metrics`) and its text rendered every second, as a scrape would; `off`: no
    /// recorder, so every metric the framework records is a no-op.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) metrics: MetricsMode,
    /// Also write every repetition's figures to this file as JSON.
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Payload size in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 256)]
    pub(crate) size: usize,
    /// Messages per transaction in the batched arms (framework and hand-written).
    #[arg(long, default_value_t = 64)]
    pub(crate) batch: usize,
    /// Partitions of the topic the Kafka arms consume (its records spread over them by key).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(i32).range(1..))]
    pub(crate) partitions: i32,
    /// Records each partition of the framework's Kafka arms buffers at most
    /// (`KafkaConfig::max_buffered_per_partition`); the transport's default if not given.
    #[arg(long, value_name = "RECORDS")]
    pub(crate) kafka_max_buffered: Option<std::num::NonZeroUsize>,
    /// Handlers (or hand-written transactions) running at once.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: usize,
    /// RabbitMQ prefetch (unacked deliveries the broker hands out at once).
    #[arg(long, default_value_t = 256)]
    pub(crate) prefetch: u16,
    /// Only the arms whose name contains one of these strings (e.g. `--arms 'memory: fw'`),
    /// or, for one ending in `$`, ends in the rest (`--arms 'kafka: fw batched$'`); every
    /// arm if not given.
    /// A comma followed by a space is part of a name (`--arms 'db floor, 1/tx$,memory: fw'`).
    #[arg(long, value_name = "NAME[,NAME...]", value_parser = ArmFilter::parse)]
    pub(crate) arms: Option<ArmFilter>,
    /// Print this process's RSS to stderr every this many milliseconds (0: never).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub(crate) rss_every_ms: u64,
    /// A perf control FIFO (`perf record --control fifo:PATH -D -1`): `enable` is written to
    /// it when an arm's clock starts and `disable` when it stops, so a profile holds the
    /// arms alone, not the filling of their queues.
    #[arg(long, value_name = "FIFO")]
    pub(crate) perf_ctl: Option<std::path::PathBuf>,
    /// Print to stderr, for every arm, this process's CPU time per message by thread name
    /// (from /proc/self/task, to the nanosecond): which threads an arm's CPU goes to.
    #[arg(long)]
    pub(crate) thread_cpu: bool,
    /// Record per-delivery latencies (1) or not (0, for long RSS runs).
    #[arg(long, value_name = "0|1", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub(crate) latency: u8,
    /// Rows a relay round takes in the `+ outbox` arms (`RelayConfig::batch`; its default
    /// unless given).
    #[arg(long, value_name = "N")]
    pub(crate) relay_batch: Option<u32>,
    /// Relay rounds in progress at once in the `+ outbox` arms (`RelayConfig::rounds`; its
    /// default unless given).
    #[arg(long, value_name = "N")]
    pub(crate) relay_rounds: Option<u32>,
    /// How long the `+ outbox` arms' relays keep published rows, in seconds
    /// (`RelayConfig::retention`; its default unless given; 0 deletes a row when published).
    #[arg(long, value_name = "SECS", env = "BENCH_RELAY_RETENTION")]
    pub(crate) relay_retention: Option<u64>,
    /// Instead of the arms: this many samples, on each broker, of the time from the commit of
    /// a message the application wrote to the outbox (on a pool of its own, so only
    /// PostgreSQL's NOTIFY wakes the relay) to the broker's confirm and to its consumption,
    /// the relay polling every 1 s (0: the arms run).
    #[arg(long, value_name = "SAMPLES", default_value_t = 0,
          conflicts_with_all = ["compare", "compare_metrics"])]
    pub(crate) outbox_latency: usize,
    /// Instead of the arms: the `Idempotency-Key` layer's cost on a trivial POST, this many
    /// requests a case (no layer; PostgreSQL store, first requests and replays; the same
    /// with the Redis fast path of `REDIS_URL`), `--reps` times (0: the arms run).
    #[arg(long, value_name = "REQUESTS", default_value_t = 0,
          conflicts_with_all = ["compare", "compare_metrics", "outbox_latency"])]
    pub(crate) http: usize,
    /// The PostgreSQL to measure (`eval "$(scripts/postgres.sh env)"` sets it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
    /// RabbitMQ for the `amqp:` arms; they are skipped without it.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub(crate) amqp_url: Option<String>,
    /// Kafka bootstrap servers for the `kafka:` arms; they are skipped without it.
    #[arg(long, env = "KAFKA_BROKERS")]
    pub(crate) kafka_brokers: Option<String>,
}

impl Options {
    /// The relay of the `+ outbox` arms: the defaults (a poll every 1 s), `--relay-batch`,
    /// `--relay-rounds`, `--relay-retention`.
    pub(crate) fn relay_config(&self) -> consumer_core::RelayConfig {
        let mut config = consumer_core::RelayConfig::default();
        if let Some(batch) = self.relay_batch {
            config = config.with_batch(batch);
        }
        if let Some(rounds) = self.relay_rounds {
            config = config.with_rounds(rounds);
        }
        if let Some(secs) = self.relay_retention {
            config = config.with_retention(std::time::Duration::from_secs(secs));
        }
        config
    }
}
