//! The randomized model test: a seeded generator of jobs, broker behaviour and faults over
//! the runtime on the in-memory broker, checked by one oracle.
//!
//! Each seed draws a set of jobs, each with a handler behaviour (succeeds, fails
//! transiently a few times, fails every time, fails permanently, panics, times out, runs
//! slowly, ignores a failed statement), how often it is published (duplicates) and in what
//! order, which of its deliveries come as redeliveries (the counted path) rather than as
//! first deliveries (the fresh path), and the faults:
//!
//! - a worker crash at a fault point (before the commit, after it, after the ack), for some
//!   of the jobs that succeed at once;
//! - lost broker connections
//!   ([`Connection::lose`](consumer_core::memory::Connection::lose)), up to two a seed
//!   (`MAX_DISCONNECTS`), each after a drawn delivery: the deliveries in flight can no
//!   longer be settled and come back redelivered; the worker's stream either goes on, as a
//!   consumer that reconnects, or ends there, and the worker is started again;
//! - where the backend has hooks for them (PostgreSQL; SQLite has neither):
//!   - a failed commit ([`Harness::commit_fault`]) for some of the jobs that succeed at
//!     once: the first commit that writes the job's effect fails, by a lost connection or a
//!     serialization failure, which must give the attempt back and retry;
//!   - terminated backends ([`Harness::db_fault`]) while the workers run.
//!
//! Workers are restarted after each crash or ended stream until the queue is drained.
//!
//! The oracle, for every job: its effect committed exactly once (one ledger row, its key
//! completed), or it is dead-lettered with the reason its behaviour calls for (no ledger
//! row, its key dead, every dead letter with that reason, one row in the inbox's
//! dead-letter table); no key is left pending. A job that fails every time may instead be
//! quarantined when a crash, a lost connection or a database fault used up its last
//! attempt. Each seed also checks that its faults were made: every drawn connection loss
//! happened, and every armed commit failed.
//!
//! [`model_seeds`] reads the seeds to run: `MODEL_SEED=S` runs seed S alone,
//! `MODEL_SEEDS=N` runs N seeds from a random start; otherwise a fixed set. A failing seed
//! is named in the failure, to be run again with `MODEL_SEED`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::inbox::{Backend, EntryStatus};
use consumer_core::memory::MemoryBroker;
use consumer_core::transport::Origin;
use consumer_core::{DeadLetterReason, Error, Handler, Worker};
use futures::{FutureExt, StreamExt};
use serde_json::json;

use crate::env::{unique, DEADLINE};
use crate::harness::{msg, CommitFailure, Harness};

/// The seeds CI runs in each mode: fixed, so a run is reproducible.
const FIXED_SEEDS: [u64; 6] = [1, 2, 3, 5, 8, 13];

/// Attempts every model job has (the handler says 3): a job that succeeds on its third
/// attempt must still complete after the crashes (at most [`MAX_CRASHES`]) and database
/// faults (at most 3) of its seed each used up one of its attempts without an outcome.
const MAX_ATTEMPTS: u32 = 8;

/// Crashes in one seed, at most.
const MAX_CRASHES: usize = 2;

/// Lost broker connections in one seed, at most.
const MAX_DISCONNECTS: u64 = 2;

/// The handler's timeout in the model: a `Timeout` job sleeps past it.
const HANDLER_TIMEOUT: Duration = Duration::from_millis(250);

/// A small, seeded generator (SplitMix64): reproducible on every platform, no dependency.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `percent` in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What a model job's handler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Ok,
    /// Fails transiently on its first n attempts.
    Transient(u32),
    FailsAlways,
    Permanent,
    Panics,
    /// Sleeps past the handler's timeout on every attempt.
    TimesOut,
    /// Sleeps a little, well within the timeout.
    Slow,
    /// Ignores a failed statement (aborts a PostgreSQL transaction, not an SQLite one).
    IgnoresFailedStatement,
}

impl Behaviour {
    fn draw(rng: &mut Rng) -> Behaviour {
        match rng.below(16) {
            0..=4 => Behaviour::Ok,
            5 => Behaviour::Transient(1),
            6 => Behaviour::Transient(2),
            7 => Behaviour::FailsAlways,
            8 => Behaviour::Permanent,
            9 => Behaviour::Panics,
            10 => Behaviour::TimesOut,
            11 | 12 => Behaviour::Slow,
            _ => Behaviour::IgnoresFailedStatement,
        }
    }

    /// The job's payload, whose fields script the scenarios' handler.
    fn payload(self, id: &str) -> serde_json::Value {
        match self {
            Behaviour::Ok => json!({ "id": id }),
            Behaviour::Transient(n) => json!({ "id": id, "fail_times": n }),
            Behaviour::FailsAlways => json!({ "id": id, "fail_times": 1000 }),
            Behaviour::Permanent => json!({ "id": id, "permanent": true }),
            Behaviour::Panics => json!({ "id": id, "panic": true }),
            Behaviour::TimesOut => {
                // Far past the timeout, which cuts every attempt short, so this costs no
                // time: a worker thread stalled past the sleep (a loaded machine) would see
                // the handler finish in the poll where the timeout is due, and commit it.
                let ms = HANDLER_TIMEOUT.as_millis() as u64 + 10_000;
                json!({ "id": id, "sleep_ms": ms })
            }
            Behaviour::Slow => json!({ "id": id, "sleep_ms": 20 }),
            Behaviour::IgnoresFailedStatement => {
                json!({ "id": id, "ignore_failed_statement": true })
            }
        }
    }

    /// How the job must end: `None` completed, else dead-lettered with the reason.
    fn expected<DB: Backend>(self) -> Option<DeadLetterReason> {
        match self {
            Behaviour::Ok | Behaviour::Transient(_) | Behaviour::Slow => None,
            Behaviour::FailsAlways | Behaviour::Panics | Behaviour::TimesOut => {
                Some(DeadLetterReason::MaxAttemptsExceeded)
            }
            Behaviour::Permanent => Some(DeadLetterReason::PermanentError),
            // PostgreSQL aborts the transaction: every attempt fails. SQLite keeps it.
            Behaviour::IgnoresFailedStatement => (<DB as sqlx::Database>::NAME == "PostgreSQL")
                .then_some(DeadLetterReason::MaxAttemptsExceeded),
        }
    }
}

/// One drawn job.
#[derive(Debug)]
struct Job {
    id: String,
    behaviour: Behaviour,
    /// How many times it is published (1 and up: duplicates).
    copies: u32,
    /// Where its worker crashes, once (only jobs that succeed at once get one, so that a
    /// crash never decides their outcome).
    crash: Option<FaultPoint>,
    /// How its first commit fails, if it does (only jobs that succeed at once get one; where
    /// the harness has no hook, it commits).
    commit_fault: Option<CommitFailure>,
}

/// A lost broker connection.
#[derive(Debug, Clone, Copy)]
struct Disconnect {
    /// The delivery after which it is lost, counted from 1 over the seed's workers.
    after: u32,
    /// The worker's stream ends there (the worker returns and a new one starts), rather
    /// than go on as a consumer that reconnects does.
    ends: bool,
}

/// One seed's draw: the jobs, the order of the publications, which deliveries come as
/// redeliveries, and how many database faults to make.
#[derive(Debug)]
struct Plan {
    jobs: Vec<Job>,
    /// Indexes into `jobs`, one per publication, shuffled.
    order: Vec<usize>,
    /// In 100: the share of deliveries handed over as redeliveries (the counted path).
    redelivered_percent: u64,
    /// Backends to terminate while the workers run (where the harness can).
    db_faults: u32,
    /// Lost broker connections, in delivery order.
    disconnects: Vec<Disconnect>,
}

impl Plan {
    fn draw(seed: u64) -> Plan {
        let mut rng = Rng::new(seed);
        let count = 8 + rng.below(9) as usize;
        let jobs: Vec<Job> = (0..count)
            .map(|i| {
                let behaviour = Behaviour::draw(&mut rng);
                let copies = if rng.chance(30) {
                    2 + rng.below(2) as u32
                } else {
                    1
                };
                let succeeds_at_once = matches!(behaviour, Behaviour::Ok | Behaviour::Slow);
                let crash = (succeeds_at_once && rng.chance(25)).then(|| {
                    [
                        FaultPoint::BeforeCommit,
                        FaultPoint::AfterCommit,
                        FaultPoint::AfterAck,
                    ][rng.below(3) as usize]
                });
                let commit_fault = (succeeds_at_once && rng.chance(20)).then(|| {
                    if rng.chance(50) {
                        CommitFailure::LostConnection
                    } else {
                        CommitFailure::SerializationFailure
                    }
                });
                Job {
                    id: format!("s{seed}-j{i}"),
                    behaviour,
                    copies,
                    crash,
                    commit_fault,
                }
            })
            .collect();
        let mut jobs = jobs;
        for job in jobs
            .iter_mut()
            .filter(|j| j.crash.is_some())
            .skip(MAX_CRASHES)
        {
            job.crash = None;
        }
        let mut order: Vec<usize> = jobs
            .iter()
            .enumerate()
            .flat_map(|(i, j)| std::iter::repeat_n(i, j.copies as usize))
            .collect();
        // Fisher-Yates: duplicates and jobs in a random order.
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        // Every publication is delivered at least once: each drawn loss happens.
        let publications = order.len() as u64;
        let mut disconnects: Vec<Disconnect> = (0..rng.below(MAX_DISCONNECTS + 1))
            .map(|_| Disconnect {
                after: 1 + rng.below(publications) as u32,
                ends: rng.chance(50),
            })
            .collect();
        disconnects.sort_by_key(|d| d.after);
        disconnects.dedup_by_key(|d| d.after);
        Plan {
            jobs,
            order,
            redelivered_percent: [0, 30, 100][rng.below(3) as usize],
            db_faults: rng.below(4) as u32,
            disconnects,
        }
    }
}

/// The seeds to run: `MODEL_SEED=S` alone, `MODEL_SEEDS=N` from a random start, or the
/// fixed set CI runs.
pub fn model_seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    if let Some(n) = std::env::var("MODEL_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() % 1_000_000)
            * 1000;
        return (start..start + n).collect();
    }
    FIXED_SEEDS.to_vec()
}

/// Runs every seed of [`model_seeds`] on `h`, one after another; a failure names its seed.
pub async fn the_model_holds_for_every_seed<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let seeds = model_seeds();
    for seed in &seeds {
        let run = std::panic::AssertUnwindSafe(run_seed(&h, *seed)).catch_unwind();
        if let Err(panic) = run.await {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!("model: seed {seed} failed (run it alone with MODEL_SEED={seed}): {why}");
        }
    }
    eprintln!("model: {} seeds held", seeds.len());
}

/// One seed: draws its plan, runs workers until the queue is drained (restarting each one
/// that crashed or whose stream ended), and checks the oracle.
async fn run_seed<DB: Backend, H: Handler<DB> + Clone>(h: &Harness<DB, H>, seed: u64) {
    let plan = Plan::draw(seed);
    let broker = MemoryBroker::new();
    let queue = unique("model");
    for &i in &plan.order {
        let job = &plan.jobs[i];
        broker.publish(&queue, msg(&job.id, job.behaviour.payload(&job.id)));
    }
    let crashes = plan
        .jobs
        .iter()
        .filter_map(|j| j.crash.map(|point| (point, j.id.clone())));
    let faults = Arc::new(CrashOnce::new(FaultAction::StopWorker, crashes));
    let failing_commits: Vec<_> = plan
        .jobs
        .iter()
        .filter_map(|j| j.commit_fault.map(|how| (j.id.clone(), how)))
        .collect();
    let commit_faults = match &h.commit_fault {
        Some(faults) if !failing_commits.is_empty() => {
            let armed: Vec<String> = failing_commits.iter().map(|(id, _)| id.clone()).collect();
            faults.arm(failing_commits).await;
            Some((faults, armed))
        }
        _ => None,
    };
    let mut config = h
        .config()
        .with_max_attempts(MAX_ATTEMPTS)
        .with_handler_timeout(HANDLER_TIMEOUT)
        .with_faults(faults);
    // The proof that the model can fail: MODEL_BROKEN=ack_before_commit.
    config.broken_ack_before_commit =
        std::env::var("MODEL_BROKEN").is_ok_and(|b| b == "ack_before_commit");

    // Each worker's inbox (a process of its own), opened before any database fault: a
    // fault during an inbox's opening fails it, as it would fail a process's start.
    let mut inboxes = Vec::new();
    for _ in 0..=MAX_CRASHES + plan.disconnects.len() {
        inboxes.push((h.new_inbox)().await);
    }
    let db_faults = match &h.db_fault {
        Some(fault) if plan.db_faults > 0 => {
            let (fault, n) = (fault.clone(), plan.db_faults);
            let mut rng = Rng::new(seed ^ 0xDB);
            Some(tokio::spawn(async move {
                for _ in 0..n {
                    let wait = Duration::from_millis(20 + rng.below(300));
                    tokio::time::sleep(wait).await;
                    fault().await;
                }
            }))
        }
        _ => None,
    };

    let (mut restarts, mut failed_starts) = (0, 0);
    // Deliveries so far, over every worker: when each drawn connection loss happens.
    let delivered = Arc::new(AtomicU32::new(0));
    let disconnects: Arc<[Disconnect]> = plan.disconnects.clone().into();
    loop {
        let inbox = inboxes
            .pop()
            .expect("an inbox for each crash and ended stream");
        let worker =
            Worker::with_config(inbox.clone(), h.handler.clone(), config.clone()).expect("worker");
        let percent = plan.redelivered_percent;
        let mut flips = Rng::new(seed ^ (restarts + 1));
        let consumer = broker.consume(&queue);
        let connection = consumer.connection();
        let (delivered, disconnects) = (delivered.clone(), disconnects.clone());
        // Whether the stream ends at the next loss it reports.
        let mut ends = false;
        let deliveries = consumer.scan((), move |_, item| {
            let item = match item {
                Ok(mut incoming) => {
                    if incoming.delivery.attempt == 1 && flips.chance(percent) {
                        incoming.delivery.origin = Origin::Unknown;
                        incoming.delivery.redelivered = true;
                    }
                    let n = delivered.fetch_add(1, Ordering::Relaxed) + 1;
                    if let Some(d) = disconnects.iter().find(|d| d.after == n) {
                        // Lost with this delivery in flight: it comes back redelivered.
                        ends = d.ends;
                        connection.lose();
                    }
                    Some(Ok(incoming))
                }
                Err(_) if ends => None,
                Err(lost) => Some(Err(lost)),
            };
            futures::future::ready(item)
        });
        let ran = tokio::time::timeout(DEADLINE, worker.run(deliveries, broker.drained(&queue)))
            .await
            .unwrap_or_else(|_| panic!("the queue was not drained in {DEADLINE:?}: {plan:?}"));
        match ran {
            Ok(()) if broker.depth(&queue).is_drained() => break,
            // The stream ended at a lost connection: a new worker, as after a crash.
            Ok(()) | Err(Error::Crashed(_)) => restarts += 1,
            // A terminated backend met by the worker's start (its check of the key template)
            // fails it before it takes a delivery, as it would fail a process's start: the
            // same process starts again, once for each fault at most.
            Err(Error::Database(_)) if db_faults.is_some() && failed_starts < plan.db_faults => {
                failed_starts += 1;
                inboxes.push(inbox);
            }
            Err(e) => panic!("the worker failed: {e}"),
        }
    }
    let faulted = restarts > 0
        || db_faults.is_some()
        || commit_faults.is_some()
        || !plan.disconnects.is_empty();
    if let Some(task) = db_faults {
        task.abort();
        let _ = task.await;
    }
    // The faults drawn were made, not only drawn.
    let lost = plan.disconnects.last().map_or(0, |d| d.after);
    assert!(
        delivered.load(Ordering::Relaxed) >= lost,
        "every drawn connection loss happened: {plan:?}"
    );
    if let Some((faults, armed)) = commit_faults {
        let tripped = faults.tripped(armed.clone()).await;
        assert_eq!(tripped, armed.len(), "every armed commit failed: {armed:?}");
    }
    // A pool of its own, opened after the last fault.
    let inbox = (h.new_inbox)().await;
    check(h, &inbox, &broker, &queue, &plan, faulted).await;
}

/// The oracle (see the module's doc).
async fn check<DB: Backend, H>(
    h: &Harness<DB, H>,
    inbox: &consumer_core::Inbox<DB>,
    broker: &MemoryBroker,
    queue: &str,
    plan: &Plan,
    faulted: bool,
) {
    let mut letters: BTreeMap<String, Vec<DeadLetterReason>> = BTreeMap::new();
    for d in broker.dead_letters(queue) {
        let key = d.dead_letter.key.clone().unwrap_or_default();
        letters.entry(key).or_default().push(d.dead_letter.reason);
    }
    let kept = inbox.dead_letters().await.expect("the dead-letter table");
    for job in &plan.jobs {
        let rows = (h.ledger)(inbox.clone(), job.id.clone()).await;
        let entry = inbox.entry("record", &job.id).await.expect("entry");
        let status = entry.as_ref().map(|e| e.status);
        let reasons = letters.get(&job.id).cloned().unwrap_or_default();
        let stored: Vec<_> = kept
            .iter()
            .filter(|l| l.location == queue && l.key.as_deref() == Some(job.id.as_str()))
            .collect();
        let seen = format!("{job:?}: rows {rows}, entry {entry:?}, dead letters {reasons:?}");
        match job.behaviour.expected::<DB>() {
            None => {
                assert_eq!(rows, 1, "the effect exactly once: {seen}");
                assert_eq!(status, Some(EntryStatus::Completed), "{seen}");
                assert!(reasons.is_empty(), "{seen}");
            }
            Some(reason) => {
                assert_eq!(rows, 0, "no effect: {seen}");
                assert_eq!(status, Some(EntryStatus::Dead), "{seen}");
                let allowed = |r: DeadLetterReason| {
                    r == reason
                        || (faulted
                            && reason == DeadLetterReason::MaxAttemptsExceeded
                            && r == DeadLetterReason::Quarantined)
                };
                assert!(
                    !reasons.is_empty() && reasons.iter().all(|r| allowed(*r)),
                    "dead-lettered with the reason {reason:?}: {seen}"
                );
                assert_eq!(
                    stored.len(),
                    1,
                    "kept once in the dead-letter table: {seen}"
                );
            }
        }
    }
    let counts = inbox.counts("record").await.expect("counts");
    assert_eq!(counts.pending, 0, "no key left pending: {counts:?}");
}

#[cfg(test)]
mod tests {
    use super::{Plan, Rng};

    #[test]
    fn a_seed_draws_the_same_plan_every_time() {
        let (a, b) = (Plan::draw(42), Plan::draw(42));
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_ne!(format!("{a:?}"), format!("{:?}", Plan::draw(43)));
        let mut rng = Rng::new(7);
        assert!((0..1000).all(|_| rng.below(10) < 10));
    }
}
