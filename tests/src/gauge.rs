//! A handler that measures how many of its runs overlap, for the bound tests: each run
//! belongs to a *lane* (one per test, named in the job), raises the lane's gauge while it
//! runs, waits for the lane's gate to open, and records one ledger row per committed run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use consumer_core::{handler, Context, HandlerError};
use serde::Deserialize;
use sqlx::Postgres;
use tokio::sync::watch;

/// A job for [`gated`].
#[derive(Debug, Deserialize)]
pub struct GatedJob {
    /// The job's id, recorded in the ledger.
    pub id: String,
    /// The lane the run counts in.
    pub lane: String,
    /// Work after the gate opened, so that runs overlap while the queue drains.
    #[serde(default)]
    pub work_ms: u64,
}

/// Runs of one test: how many run now, the most that ever ran at once, and the gate.
pub struct Lane {
    running: AtomicUsize,
    max: AtomicUsize,
    runs: AtomicU64,
    gate: watch::Sender<bool>,
}

impl Lane {
    /// The lane named `name`, created closed on first use.
    pub fn get(name: &str) -> Arc<Lane> {
        static LANES: OnceLock<Mutex<HashMap<String, Arc<Lane>>>> = OnceLock::new();
        let lanes = LANES.get_or_init(Default::default);
        lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Lane {
                    running: AtomicUsize::new(0),
                    max: AtomicUsize::new(0),
                    runs: AtomicU64::new(0),
                    gate: watch::channel(false).0,
                })
            })
            .clone()
    }

    /// Handler runs under way now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// The most runs ever under way at once.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    /// Runs started.
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    /// Lets every waiting and later run through.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }
}

/// Decrements the gauge however the run ends (a timeout drops the future).
struct Running(Arc<Lane>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts itself in its lane's gauge, waits for the gate, works, and records a ledger row.
#[handler(
    name = "gated",
    max_attempts = 3,
    backoff = "200ms..1s",
    timeout = "300s"
)]
pub async fn gated(ctx: &mut Context<'_, Postgres>, job: GatedJob) -> Result<(), HandlerError> {
    let lane = Lane::get(&job.lane);
    lane.runs.fetch_add(1, Ordering::SeqCst);
    let now = lane.running.fetch_add(1, Ordering::SeqCst) + 1;
    lane.max.fetch_max(now, Ordering::SeqCst);
    let _running = Running(lane.clone());
    let mut gate = lane.gate.subscribe();
    gate.wait_for(|open| *open)
        .await
        .map_err(|_| HandlerError::transient("the lane's gate was dropped"))?;
    tokio::time::sleep(Duration::from_millis(job.work_ms)).await;
    let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(attempt)
        .execute(ctx.db())
        .await?;
    Ok(())
}
