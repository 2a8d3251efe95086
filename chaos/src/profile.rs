//! What a run is asked to do: the broker, the profile (how many jobs, how often each fault),
//! and the command line that picks them.

use std::time::Duration;

use anyhow::bail;

use crate::database::StopMode;

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BrokerKind {
    /// RabbitMQ (AMQP_URL).
    #[value(alias = "rabbitmq")]
    Amqp,
    /// Kafka (KAFKA_BROKERS).
    Kafka,
}

/// How hard and how long.
#[derive(Debug, Clone)]
pub(crate) struct Profile {
    pub(crate) name: &'static str,
    pub(crate) unique: usize,
    pub(crate) poison: usize,
    pub(crate) publish_for: Duration,
    pub(crate) kill_every: Duration,
    pub(crate) stop_every: Duration,
    pub(crate) stop_for: Duration,
    pub(crate) broker_restarts: u32,
    /// PostgreSQL restarts, in this order, spread over the publishing window.
    pub(crate) db_restarts: &'static [StopMode],
    /// Terminate one of the run's worker backends about this often.
    pub(crate) terminate_every: Duration,
    /// Pool-exhaustion windows (spread over the publishing window) and their length.
    pub(crate) exhaust_windows: u32,
    pub(crate) exhaust_for: Duration,
    pub(crate) fault_rate: f64,
    pub(crate) drain_deadline: Duration,
    /// Kafka: add or remove a group member this often.
    pub(crate) member_every: Duration,
    /// Against the three-node cluster: each broker restart kills a node (CHAOS.md).
    pub(crate) cluster: bool,
}

/// The relay's fault points abort at the profile's rate divided by this (see
/// [`Profile::faults`]).
const RELAY_FAULT_DIVISOR: f64 = 10.0;

impl Profile {
    /// The workers' fault points and their rates (`CONSUMER_FAULTS`): the runtime's at
    /// `fault_rate` each. The relay's are checked for every row of a round (up to
    /// `RelayConfig::batch`, 500 rows), and a crash undoes the whole round's marks (its rows
    /// go out again from the next relay): at the workers' rate a full round would meet 10
    /// crashes on average and a backlog would never drain. At a tenth of it about a third
    /// of the full rounds complete, and most of the smaller ones.
    pub(crate) fn faults(&self) -> String {
        let r = self.fault_rate;
        let relay = r / RELAY_FAULT_DIVISOR;
        format!(
            "before_commit={r},after_commit={r},after_ack={r},in_effect={r},\
             outbox_before_publish={relay},outbox_after_publish={relay}"
        )
    }

    pub(crate) fn new(name: &str, broker: BrokerKind) -> anyhow::Result<Self> {
        let restarts = |n| n;
        Ok(match name {
            "ci" => Profile {
                name: "ci",
                unique: 2_000,
                poison: 20,
                publish_for: Duration::from_secs(60),
                kill_every: Duration::from_secs(2),
                stop_every: Duration::from_secs(20),
                stop_for: Duration::from_secs(4),
                broker_restarts: restarts(1),
                db_restarts: &[StopMode::Immediate],
                terminate_every: Duration::from_secs(3),
                exhaust_windows: 1,
                exhaust_for: Duration::from_secs(5),
                fault_rate: 0.01,
                // A deadline, not a wait: a run ends when it has drained (poison jobs spend
                // about 40 s in the invoice handler's retries before their dead letter, and
                // far longer when their attempts are cut short by kills and aborts; in CI
                // the runs share 2 cores with the other broker's runs).
                drain_deadline: Duration::from_secs(600),
                member_every: Duration::from_secs(10),
                cluster: false,
            },
            "cluster" => Profile {
                name: "cluster",
                broker_restarts: restarts(3),
                cluster: true,
                ..Profile::new("ci", broker)?
            },
            "full" => Profile {
                name: "full",
                unique: 10_000,
                poison: 50,
                publish_for: Duration::from_secs(480),
                kill_every: Duration::from_secs(2),
                stop_every: Duration::from_secs(20),
                stop_for: Duration::from_secs(5),
                broker_restarts: restarts(3),
                db_restarts: &[StopMode::Fast, StopMode::Immediate],
                terminate_every: Duration::from_secs(3),
                exhaust_windows: 3,
                exhaust_for: Duration::from_secs(8),
                fault_rate: 0.01,
                drain_deadline: Duration::from_secs(600),
                member_every: Duration::from_secs(15),
                cluster: false,
            },
            other => bail!("--profile {other:?}: use ci, cluster or full"),
        }
        .for_broker(broker))
    }

    /// The Kafka runs' workers are static group members (named after their slot), so a
    /// killed worker's restart takes its partitions back without a rebalance, and they are
    /// killed as often as the RabbitMQ runs' (CHAOS.md has the measurements); members added
    /// and removed still rebalance the groups, every 15 s.
    pub(crate) fn for_broker(mut self, broker: BrokerKind) -> Self {
        if broker == BrokerKind::Kafka {
            self.member_every = Duration::from_secs(15);
        }
        self
    }
}

/// The command line, parsed by clap (`--help` lists it).
#[derive(Debug, clap::Parser)]
#[command(
    name = "chaos",
    about = "The chaos suite: runs the invoice example's workers against a real broker and \
             PostgreSQL, kills and restarts them, then checks that every job's effects \
             happened exactly once.",
    after_help = "Exit status: 0 when the oracle passes, 3 on a violation, 1 when the run \
                  could not be done. Needs DATABASE_URL and AMQP_URL or KAFKA_BROKERS \
                  (eval \"$(scripts/servers.sh env)\")."
)]
pub(crate) struct Cli {
    /// The broker to run against.
    #[arg(long, value_enum, env = "CHAOS_BROKER")]
    pub(crate) broker: BrokerKind,
    /// How hard and how long (CHAOS.md describes both profiles).
    #[arg(long, value_enum, default_value = "ci", env = "CHAOS_PROFILE")]
    pub(crate) profile: ProfileName,
    /// The seed of the fault schedule (default: random, printed); the same seed replays
    /// the same schedule.
    #[arg(long, env = "CHAOS_SEED")]
    pub(crate) seed: Option<u64>,
    /// Test-only: the workers ack every delivery before its handler runs, so the oracle
    /// must report a violation.
    #[arg(long)]
    pub(crate) broken: bool,
    /// Batched mode: deliveries per transaction (0: one per transaction).
    #[arg(long, default_value_t = 0)]
    pub(crate) batch: usize,
    /// Worker processes at the start (at least 2), cycling through `invoice_worker`,
    /// `email_worker` and `invoices` (both handlers in one process).
    #[arg(long, default_value_t = 4, value_parser = at_least_two)]
    pub(crate) workers: usize,
    /// Publish for this many seconds instead of the profile's time.
    #[arg(long, value_name = "SECS")]
    pub(crate) publish_secs: Option<u64>,
    /// Kill a worker every this many milliseconds instead of the profile's period (0: never).
    #[arg(long, value_name = "MS")]
    pub(crate) kill_ms: Option<u64>,
    /// Probability that each fault point aborts a worker, instead of the profile's rate.
    #[arg(long, value_name = "P", value_parser = probability)]
    pub(crate) fault_rate: Option<f64>,
    /// Make 1 % of the jobs (order ids ending in 37) this much slower in both handlers
    /// (0: none). Under the profiles' faults on Kafka such jobs end quarantined (CHAOS.md).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub(crate) slow_job_ms: u64,
    /// Do not build the worker binaries first (they must exist next to this binary).
    #[arg(long)]
    pub(crate) no_build: bool,
    /// Keep the run's schema, queues or topics and worker logs even when it passes.
    #[arg(long)]
    pub(crate) keep: bool,
}

/// The profiles, by name.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ProfileName {
    /// 2,000 jobs (and 20 poison ones) published over 60 s, one broker restart, an
    /// immediate PostgreSQL restart and a pool-exhaustion window.
    Ci,
    /// 10,000 jobs (and 50 poison ones) published over 480 s, three broker restarts, a
    /// fast and an immediate PostgreSQL restart and three pool-exhaustion windows.
    Full,
    /// The `ci` profile against the three-node cluster, where each of three broker
    /// restarts is a node (the jobs' leader) SIGKILLed and started again.
    Cluster,
}

pub(crate) fn at_least_two(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n < 2 {
        return Err("at least 2 (an invoice worker and an email worker)".to_owned());
    }
    Ok(n)
}

pub(crate) fn probability(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if !(0.0..=1.0).contains(&p) {
        return Err("a probability between 0 and 1".to_owned());
    }
    Ok(p)
}

/// What a run uses: the command line with the profile's values resolved.
#[derive(Debug)]
pub(crate) struct Args {
    pub(crate) broker: BrokerKind,
    pub(crate) profile: Profile,
    pub(crate) seed: u64,
    pub(crate) broken: bool,
    pub(crate) workers: usize,
    /// Batched mode: deliveries per transaction (0: one per transaction).
    pub(crate) batch: usize,
    /// Slow jobs' extra time in milliseconds (0: none).
    pub(crate) slow_job_ms: u64,
    pub(crate) build: bool,
    pub(crate) keep: bool,
}

impl Args {
    pub(crate) fn parse() -> anyhow::Result<Self> {
        Self::from_cli(<Cli as clap::Parser>::parse())
    }

    pub(crate) fn from_cli(cli: Cli) -> anyhow::Result<Self> {
        let name = match cli.profile {
            ProfileName::Ci => "ci",
            ProfileName::Full => "full",
            ProfileName::Cluster => "cluster",
        };
        let mut profile = Profile::new(name, cli.broker)?;
        if let Some(s) = cli.publish_secs {
            profile.publish_for = Duration::from_secs(s);
        }
        if let Some(r) = cli.fault_rate {
            profile.fault_rate = r;
        }
        match cli.kill_ms {
            Some(0) => profile.kill_every = Duration::MAX,
            Some(ms) => profile.kill_every = Duration::from_millis(ms),
            None => {}
        }
        let seed = cli.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() % 100_000)
                .unwrap_or(1)
        });
        Ok(Args {
            broker: cli.broker,
            profile,
            seed,
            broken: cli.broken,
            workers: cli.workers,
            batch: cli.batch,
            slow_job_ms: cli.slow_job_ms,
            build: !cli.no_build,
            keep: cli.keep,
        })
    }
}
