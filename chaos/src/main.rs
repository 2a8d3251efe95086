//! The chaos suite: runs the invoice example's workers (the invoice handler with the
//! outbox's relay, the email handler, and both in one process) as real processes against a
//! real broker and PostgreSQL, kills them, stops them, restarts the broker and the database,
//! terminates their database sessions and holds every free connection slot for a while,
//! lets fault points abort them (in the handlers and in the relay), and then checks that
//! every job's effects happened exactly once, across the outbox's publish too.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run --release -p chaos -- --broker amqp --profile ci [--seed N] [--broken]
//! ```
//!
//! It builds the worker binaries first (`cargo build -p chaos -p invoices --bins`, same
//! profile as itself; `--no-build` skips that) and runs them from its own directory. Each run uses its own PostgreSQL schema
//! and its own queues or topics (`chaos_<seed>_<time>_<pid>`). Exit status: 0 when the oracle
//! passes, 3 on any violation ([`VIOLATION`]), 1 when the run itself could not be done.
//!
//! Layout: `workload` (what is published), `fleet` (the worker processes), `amqp` and
//! `kafka` (the brokers), `database` (the database faults), `oracle` (the checks and
//! figures).

// A command-line tool: its report is its standard output.
#![allow(clippy::print_stdout)]

mod amqp;
mod broker;
mod cluster;
mod database;
mod fleet;
mod kafka;
mod oracle;
mod profile;
mod report;
mod rng;
mod workload;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use sqlx::PgPool;

use crate::broker::Broker;
pub(crate) use crate::broker::{DeadSeen, Names};
use crate::database::{Db, DbFigures, StopMode};
use crate::fleet::{Fleet, Role};
use crate::profile::{Args, BrokerKind};
use crate::rng::Rng;
use crate::workload::Workload;

/// The exit status of a run whose oracle found a violation.
const VIOLATION: i32 = 3;

/// The repository's `scripts/` directory.
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// Runs a script, failing with its output.
pub(crate) async fn script(path: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(path)
        .args(args)
        .output()
        .await
        .with_context(|| format!("run {}", path.display()))?;
    if !out.status.success() {
        bail!(
            "{} {args:?} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Builds the example's worker binaries with the runner's own profile and returns the
/// directory they are in (the runner's own).
fn worker_binaries(build: bool) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locate the chaos binary")?;
    let dir = exe
        .parent()
        .context("the chaos binary has no directory")?
        .to_path_buf();
    if build {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let mut cmd = std::process::Command::new(cargo);
        // With `-p chaos` too, cargo resolves features as it did for this binary, so this
        // reuses what `cargo run -p chaos` just compiled instead of a second build.
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "chaos",
            "-p",
            "invoices",
            "--bins",
            "--manifest-path",
        ])
        .arg(&manifest);
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let status = cmd.status().context("run cargo build -p invoices --bins")?;
        if !status.success() {
            bail!("cargo build -p invoices --bins failed");
        }
    }
    for role in Role::ALL {
        let bin = dir.join(role.binary());
        if !bin.is_file() {
            bail!(
                "{} not found next to the chaos binary: run `cargo build --release -p invoices --bins`",
                bin.display()
            );
        }
    }
    Ok(dir)
}

/// Inbox keys with an attempt counted and no outcome yet, plus outbox events not published
/// yet; `None` if the database cannot say right now.
async fn unsettled(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM consumer_inbox WHERE status = 'pending') \
         + (SELECT count(*) FROM consumer_inbox_outbox WHERE published_at IS NULL)",
    )
    .fetch_one(pool)
    .await
    .ok()
}

/// What happened during the run, besides what the fleet counts.
#[derive(Debug, Default)]
pub(crate) struct Happened {
    pub(crate) published: u64,
    pub(crate) publish_retries: u64,
    pub(crate) broker_restarts: u32,
    pub(crate) drained: bool,
    pub(crate) errors: Vec<String>,
}

#[tokio::main]
async fn main() {
    // The runner's own clients (the publisher, the readers): librdkafka's and the
    // transports' warnings, on stderr; `CHAOS_LOG` filters them as RUST_LOG would.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CHAOS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let code = match run().await {
        Ok(true) => 0,
        Ok(false) => VIOLATION,
        Err(e) => {
            eprintln!("chaos: error: {e:#}");
            println!("chaos: 0 passed, 1 failed (error)");
            1
        }
    };
    std::process::exit(code);
}

async fn run() -> anyhow::Result<bool> {
    let args = Args::parse()?;
    let p = args.profile.clone();
    let bin_dir = worker_binaries(args.build)?;
    let names = Names::new(args.seed);
    let scripts = scripts_dir();
    let log_dir = std::env::temp_dir().join(&names.prefix);
    std::fs::create_dir_all(&log_dir)?;
    let broker_name = match args.broker {
        BrokerKind::Amqp => "RabbitMQ",
        BrokerKind::Kafka => "Apache Kafka",
    };
    println!(
        "chaos: {broker_name}, profile {}, seed {}, {} workers, {}{}; schema and queues {}; worker logs in {}",
        p.name,
        args.seed,
        args.workers,
        match args.batch {
            0 => "one transaction per message".to_owned(),
            n => format!("batched mode ({n} per transaction)"),
        },
        if args.broken { ", BROKEN ack-before-commit" } else { "" },
        names.prefix,
        log_dir.display()
    );

    let mut rng = Rng::new(args.seed);
    let workload = Workload::new(p.unique, p.poison, 3 * 1024 * 1024, &mut rng);
    let db = Db::from_env(&names.prefix, &names.schema)?;
    let pool = db.runner_pool().await?;
    database::patiently("create the schema", || {
        invoices::schema::migrate(&pool, &names.schema)
    })
    .await?;
    database::patiently("place the orders", || {
        invoices::schema::place_orders(&pool, &workload.orders)
    })
    .await?;

    let broker = match args.broker {
        BrokerKind::Amqp => {
            Broker::Amqp(amqp::Amqp::connect(&names, scripts.clone(), p.cluster).await?)
        }
        BrokerKind::Kafka => {
            Broker::Kafka(kafka::Kafka::connect(&names, scripts.clone(), p.cluster).await?)
        }
    };
    // The workers' connections carry the run's prefix as their application_name: the
    // database faults target them and no other session.
    let database_url = db.worker_url();
    let mut env = broker.worker_env();
    env.extend(names.vars().into_iter().map(|(k, v)| (k.to_owned(), v)));
    env.extend(
        [
            ("DATABASE_URL", database_url),
            ("DB_SCHEMA", names.schema.clone()),
            ("CONCURRENCY", "8".to_owned()),
            ("BATCH_SIZE", args.batch.to_string()),
            ("STATS_INTERVAL_MS", "1000".to_owned()),
            (
                "RUST_LOG",
                std::env::var("CHAOS_WORKER_LOG")
                    .unwrap_or_else(|_| "warn,lapin=off,rdkafka=off".to_owned()),
            ),
            (
                "CONSUMER_BROKEN_ACK_BEFORE_COMMIT",
                if args.broken { "1" } else { "0" }.to_owned(),
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    if args.slow_job_ms > 0 {
        env.push(("SLOW_JOB_MS".to_owned(), args.slow_job_ms.to_string()));
    }
    let mut fleet = Fleet::new(&bin_dir, &log_dir, env, Some(p.faults()), args.seed);
    if args.broker == BrokerKind::Kafka {
        // Static membership: a worker restarted in its slot takes its partitions back at
        // once (CHAOS.md).
        fleet.name_members(&names.prefix);
    }
    for i in 0..args.workers {
        fleet.add(Role::ALL[i % Role::ALL.len()])?;
    }
    let first_extra = args.workers;

    let start = Instant::now();
    let broker = std::sync::Arc::new(broker);
    // The publisher: paced over the publishing window, each message retried until the
    // broker confirms it (a retried message may arrive twice: same id, deduplicated).
    let publisher = {
        let broker = broker.clone();
        let messages = workload.messages.clone();
        let window = p.publish_for;
        tokio::spawn(async move {
            let mut published = 0u64;
            let mut retries = 0u64;
            let n = messages.len().max(1) as u32;
            for (k, m) in messages.iter().enumerate() {
                let due = start + window * u32::try_from(k).unwrap_or(u32::MAX) / n;
                tokio::time::sleep_until(due.into()).await;
                let mut tries = 0;
                loop {
                    match broker.publish(m).await {
                        Ok(()) => break,
                        Err(e) if tries < 60 => {
                            tries += 1;
                            retries += 1;
                            eprintln!("chaos: publish {}: {e:#}; retrying", m.label());
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => return Err(e.context(format!("publish {}", m.label()))),
                    }
                }
                published += 1;
            }
            Ok::<_, anyhow::Error>((published, retries))
        })
    };

    let at = |fraction: f64| p.publish_for.mul_f64(fraction);
    let mut broker_restart_at: Vec<Duration> = (0..p.broker_restarts)
        .map(|k| at((f64::from(k) + 0.5) / f64::from(p.broker_restarts.max(1)) * 0.9))
        .collect();
    let n = p.db_restarts.len() as f64;
    let mut db_restart_at: Vec<(Duration, StopMode)> = (p.db_restarts.iter().enumerate())
        .map(|(k, mode)| (at((k as f64 + 0.65) / n), *mode))
        .collect();
    let mut exhaust_at: Vec<Duration> = (0..p.exhaust_windows)
        .map(|k| at((f64::from(k) + 0.35) / f64::from(p.exhaust_windows.max(1))))
        .collect();
    let mut exhausting: Option<tokio::task::JoinHandle<anyhow::Result<()>>> = None;
    let db_figures = std::sync::Arc::new(DbFigures::default());
    let terminator = database::spawn_terminator(
        db.clone(),
        pool.clone(),
        p.terminate_every,
        args.seed,
        db_figures.clone(),
    );
    let mut happened = Happened::default();
    let mut restarting: Option<tokio::task::JoinHandle<anyhow::Result<()>>> = None;
    let mut next_kill = p.kill_every;
    let mut next_stop = p.stop_every / 2;
    let mut stopped: Option<(usize, Duration)> = None;
    let mut next_member = p.member_every;
    let mut add_next = true;
    let mut publisher = Some(publisher);
    let mut published_at: Option<Duration> = None;
    let mut next_check = Duration::ZERO;
    let mut empty_checks = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = start.elapsed();
        fleet.reap()?;
        if now >= next_kill {
            fleet.kill_random(&mut rng);
            next_kill = next_kill.saturating_add(p.kill_every);
        }
        match stopped {
            Some((i, until)) if now >= until => {
                fleet.resume(i);
                stopped = None;
            }
            None if now >= next_stop => {
                stopped = fleet.stop_random(&mut rng).map(|i| (i, now + p.stop_for));
                next_stop += p.stop_every;
            }
            _ => {}
        }
        if let Some(task) = restarting.take_if(|t| t.is_finished()) {
            if let Err(e) = task.await? {
                happened.errors.push(format!("{e:#}"));
            }
        }
        if restarting.is_none() {
            if broker_restart_at.first().is_some_and(|t| now >= *t) {
                broker_restart_at.remove(0);
                happened.broker_restarts += 1;
                eprintln!("chaos: [{:.0}s] restarting the broker", now.as_secs_f64());
                let broker = broker.clone();
                restarting = Some(tokio::spawn(async move { broker.restart().await }));
            } else if db_restart_at.first().is_some_and(|(t, _)| now >= *t) {
                let (_, mode) = db_restart_at.remove(0);
                eprintln!(
                    "chaos: [{:.0}s] restarting PostgreSQL ({mode:?})",
                    now.as_secs_f64()
                );
                let (scripts, figures) = (scripts.clone(), db_figures.clone());
                restarting = Some(tokio::spawn(async move {
                    database::restart(&scripts, mode, &figures).await
                }));
            }
        }
        if let Some(task) = exhausting.take_if(|t| t.is_finished()) {
            if let Err(e) = task.await? {
                happened.errors.push(format!("pool exhaustion: {e:#}"));
            }
        }
        if exhausting.is_none() && exhaust_at.first().is_some_and(|t| now >= *t) {
            exhaust_at.remove(0);
            eprintln!(
                "chaos: [{:.0}s] holding the free connection slots for {:?}",
                now.as_secs_f64(),
                p.exhaust_for
            );
            let (db, figures, hold) = (db.clone(), db_figures.clone(), p.exhaust_for);
            exhausting = Some(tokio::spawn(
                async move { db.exhaust(hold, &figures).await },
            ));
        }
        if args.broker == BrokerKind::Kafka && published_at.is_none() && now >= next_member {
            next_member += p.member_every;
            if add_next {
                let pick = usize::try_from(rng.below(Role::ALL.len() as u64)).unwrap_or(0);
                fleet.add(Role::ALL[pick])?;
                fleet.counts.joined += 1;
            } else {
                // Gracefully: a static member's SIGTERM does not leave the group, so its
                // partitions wait for its session timeout, then move.
                fleet.remove_extra(first_extra, &mut rng, false);
            }
            add_next = !add_next;
        }
        if let Some(task) = publisher.take_if(|t| t.is_finished()) {
            let (published, retries) = task.await??;
            happened.published = published;
            happened.publish_retries = retries;
            published_at = Some(now);
            eprintln!(
                "chaos: [{:.0}s] published {published} messages; draining",
                now.as_secs_f64()
            );
        }
        let Some(published_at) = published_at else {
            continue;
        };
        if now < next_check {
            continue;
        }
        next_check = now + Duration::from_secs(1);
        let quiet = restarting.is_none()
            && exhausting.is_none()
            && broker_restart_at.is_empty()
            && db_restart_at.is_empty()
            && exhaust_at.is_empty();
        // Drained: the queues are empty (RabbitMQ's counts of quorum queues can lag a few
        // seconds, so a retry copy just confirmed into one may not show yet), no key in
        // the inbox is pending, i.e. none has an attempt counted without an outcome (every
        // key ends completed or dead in a run that loses nothing), and the outbox has
        // published every event. The broken build loses deliveries with keys left pending,
        // so it drains on the queues alone.
        let settled = args.broken || unsettled(&pool).await == Some(0);
        match broker.backlog().await {
            Some(0) if quiet && settled => empty_checks += 1,
            _ => empty_checks = 0,
        }
        if empty_checks >= 3 {
            happened.drained = true;
            break;
        }
        if now > published_at + p.drain_deadline {
            happened.errors.push(format!(
                "not drained {:?} after publishing",
                p.drain_deadline
            ));
            break;
        }
    }
    if let Some((i, _)) = stopped {
        fleet.resume(i);
    }
    if let Some(task) = restarting {
        if let Err(e) = task.await? {
            happened.errors.push(format!("{e:#}"));
        }
    }
    if let Some(task) = exhausting {
        if let Err(e) = task.await? {
            happened.errors.push(format!("pool exhaustion: {e:#}"));
        }
    }
    terminator.abort();
    let drained_after = start.elapsed();
    fleet.shutdown(Duration::from_secs(60)).await?;
    let elapsed = start.elapsed();

    let dead = broker.dead_letters().await?;
    let verdict = database::patiently("check", || oracle::check(&pool, &workload, &dead)).await?;
    let figures = database::patiently("read the figures", || oracle::worker_figures(&pool)).await?;
    let c = &fleet.counts;
    let passed = verdict.passed() && happened.drained && c.unexpected_exits.is_empty();

    report::print(&report::Run {
        broker_name,
        args: &args,
        workload: &workload,
        happened: &happened,
        counts: c,
        figures: &figures,
        verdict: &verdict,
        db_figures: &db_figures,
        drained_after,
        elapsed,
    });
    println!();
    if passed {
        println!("OK: every job's effects happened exactly once.");
    }
    // A --broken run is expected to fail: nothing in it is worth keeping.
    if (passed || args.broken) && !args.keep {
        broker.cleanup().await?;
        let drop = format!("DROP SCHEMA \"{}\" CASCADE", names.schema);
        database::patiently("drop the schema", || sqlx::query(&drop).execute(&pool)).await?;
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    if passed {
        println!("chaos: 1 passed, 0 failed");
    } else {
        if !args.broken || args.keep {
            println!(
                "FAILED: kept schema {} and worker logs in {}",
                names.schema,
                log_dir.display()
            );
        }
        if args.broken {
            // Not a pass/fail count: for a --broken run, a violation is the expected outcome.
            println!("chaos: violation detected, as a --broken run must");
        } else {
            println!("chaos: 0 passed, 1 failed");
        }
    }
    Ok(passed)
}
