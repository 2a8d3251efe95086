//! The execute stage: a group of claimed jobs runs in one transaction with the inbox's
//! claim (fresh) or completion (counted), and commits once. If a handler fails in a group
//! of several, the transaction rolls back and each job runs again alone, through the same
//! code, so one failure never sinks or half-commits the others.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::FutureExt;

use super::inner::{Crash, Inner};
use super::job::Job;
use super::settle::Settled;
use super::verdict::Attempted;
use crate::fault::point::FaultPoint;
use crate::handler::{BatchContext, BatchMember, Context, Handler, Written};
use crate::inbox::{is_aborted, Backend, Lease};
use crate::HandlerError;

/// Whether the database refused a statement because a row with its key exists.
fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

/// How a group's transaction ended.
enum Ended {
    /// Every fresh key had a row already: nothing left to run.
    Nothing,
    /// No transaction could begin, or the fresh claim failed: no handler ran.
    NotRun(sqlx::Error),
    /// A handler failed: rolled back.
    Failed(HandlerError),
    /// A key was overtaken at the completion: rolled back.
    Overtaken,
    /// Committed; `wrote`: a handler wrote to the outbox, whose relays are then woken.
    Committed {
        wrote: bool,
    },
    CommitFailed(sqlx::Error),
}

/// What a group's transaction leaves to its caller.
struct Transacted<M> {
    ended: Ended,
    /// The fresh jobs whose keys had a row already, taken out of the group before the
    /// handlers ran: each takes the counted path by itself after the batch.
    had_rows: Vec<Job<M>>,
    /// The completion released the lease's database locks.
    unlocked: bool,
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// Runs the claimed `jobs` (all fresh or all counted, as `fresh` says) on the lease's
    /// connection and pushes each verdict to `settled`; a fresh job whose key has a row
    /// already, or a job of a group whose statement the inbox refused, goes to `alone`, to
    /// take the counted path by itself after the batch.
    pub(super) async fn execute(
        &self,
        lease: &mut Lease<DB>,
        jobs: Vec<Job<H::Message>>,
        fresh: bool,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Job<H::Message>>,
    ) -> Result<(), Crash> {
        self.execute_on(lease, jobs, fresh, true, settled, alone)
            .await
    }

    /// [`Inner::execute`]; `first`: the group's first transaction, whose completion releases
    /// the lease's database locks. The one-by-one reruns keep them until the lease is
    /// released, so that no other worker counts an attempt on their keys meanwhile.
    async fn execute_on(
        &self,
        lease: &mut Lease<DB>,
        mut jobs: Vec<Job<H::Message>>,
        fresh: bool,
        first: bool,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Job<H::Message>>,
    ) -> Result<(), Crash> {
        let together = jobs.len() > 1;
        let (conn, held) = lease.held();
        let held = if first { held } else { &[] };
        let transacted = self.transaction(conn, held, &mut jobs, fresh).await?;
        if transacted.unlocked {
            lease.released_in_db();
        }
        alone.extend(transacted.had_rows);
        let failed = match transacted.ended {
            Ended::Nothing => return Ok(()),
            Ended::NotRun(e) => {
                lease.spoil();
                self.retry_all_after_db_error(&e, jobs, settled, alone);
                return Ok(());
            }
            Ended::Committed { wrote } => {
                if together {
                    self.stats.batches.bump();
                }
                if wrote {
                    self.inbox.inbox().outbox_written();
                }
                None
            }
            Ended::CommitFailed(e) => {
                lease.spoil();
                if together {
                    tracing::warn!(error = %e, "batch commit failed");
                }
                Some(Arc::new(e))
            }
            Ended::Failed(failure) if !together => {
                let mut job = jobs.pop().expect("a group of one");
                let verdict = self
                    .conclude(lease.conn(), &mut job, Attempted::Failed(failure))
                    .await;
                settled.push(self.settled(job, verdict));
                return Ok(());
            }
            Ended::Overtaken if !together => {
                let mut job = jobs.pop().expect("a group of one");
                let verdict = self
                    .conclude(lease.conn(), &mut job, Attempted::Overtaken)
                    .await;
                settled.push(self.settled(job, verdict));
                return Ok(());
            }
            Ended::Failed(_) | Ended::Overtaken => {
                // One by one, each in its own transaction; the locks and the counted claims
                // are still held, so no attempt is counted twice.
                for job in jobs {
                    let one = vec![job];
                    Box::pin(self.execute_on(lease, one, fresh, false, settled, alone)).await?;
                }
                return Ok(());
            }
        };
        let Some(e) = failed else {
            self.committed(jobs, settled);
            return Ok(());
        };
        for mut job in jobs {
            let attempted = Attempted::CommitFailed(e.clone());
            let verdict = self.conclude(lease.conn(), &mut job, attempted).await;
            settled.push(self.settled(job, verdict));
        }
        Ok(())
    }

    /// One transaction over `jobs`: claim the fresh keys (those that have a row already
    /// leave `jobs`, see [`Transacted::had_rows`]), run the handlers, complete the counted
    /// keys (releasing the database locks `unlock` in that statement), commit.
    async fn transaction(
        &self,
        conn: &mut DB::Connection,
        unlock: &[i64],
        jobs: &mut Vec<Job<H::Message>>,
        fresh: bool,
    ) -> Result<Transacted<H::Message>, Crash> {
        let mut had_rows = Vec::new();
        let mut unlocked = false;
        // Each way the transaction ends leaves this block with its `Ended`.
        let ended = 'ended: {
            let mut tx = match self.inbox.begin(conn).await {
                Ok(tx) => tx,
                Err(e) => break 'ended Ended::NotRun(e),
            };
            if fresh {
                let items: Vec<(&str, &str)> =
                    jobs.iter().map(|j| (j.key(), j.hash.as_str())).collect();
                // A batch's keys may be claimed by the plain insert (see `Claims`); one key is
                // claimed by a statement of its own, which tolerates a row.
                let optimistic = items.len() > 1 && self.claims.optimistic();
                let claimed = match self.inbox.claim_fresh(&mut tx, &items, optimistic).await {
                    Err(e) if optimistic && is_unique_violation(&e) => {
                        // A key had a row after all (a republished message): that statement
                        // failed the transaction. Claim again in a new one, keeping the keys
                        // with rows apart.
                        self.claims.found_rows();
                        tracing::debug!("a fresh key of the batch had a row; claiming again");
                        if let Err(e) = tx.rollback().await {
                            break 'ended Ended::NotRun(e);
                        }
                        tx = match self.inbox.begin(conn).await {
                            Ok(tx) => tx,
                            Err(e) => break 'ended Ended::NotRun(e),
                        };
                        self.inbox.claim_fresh(&mut tx, &items, false).await
                    }
                    claimed => claimed,
                };
                match claimed {
                    Ok(taken) if taken.is_empty() => {}
                    Ok(taken) => {
                        let rest;
                        (rest, had_rows) = std::mem::take(jobs)
                            .into_iter()
                            .partition(|j| !taken.iter().any(|t| t == j.key()));
                        *jobs = rest;
                    }
                    Err(e) => break 'ended Ended::NotRun(e),
                }
                if jobs.is_empty() {
                    if let Err(e) = tx.rollback().await {
                        tracing::debug!(error = %e, "rollback failed");
                    }
                    break 'ended Ended::Nothing;
                }
            }
            let wrote = AtomicBool::new(false);
            if let Err(failure) = self.run_handlers(&mut tx, &wrote, jobs).await? {
                if let Err(rb) = tx.rollback().await {
                    tracing::warn!(error = %rb, "rollback failed");
                }
                break 'ended Ended::Failed(failure);
            }
            if fresh {
                // On the counted path the completion below is this check.
                if let Err(e) = self.inbox.check_not_aborted(&mut tx).await {
                    break 'ended self.ended_by(tx, e, jobs.len()).await;
                }
            }
            for job in jobs.iter() {
                self.fault(FaultPoint::BeforeCommit, job.key())?;
            }
            if !fresh {
                let items: Vec<(&str, u32)> = jobs.iter().map(|j| (j.key(), j.attempt)).collect();
                match self.inbox.complete(&mut tx, &items, unlock).await {
                    Ok(n) => {
                        unlocked = !unlock.is_empty();
                        if n != jobs.len() as u64 {
                            // A key was overtaken by another worker: its handler's writes must
                            // not commit.
                            if let Err(rb) = tx.rollback().await {
                                tracing::warn!(error = %rb, "rollback failed");
                            }
                            break 'ended Ended::Overtaken;
                        }
                    }
                    Err(e) => break 'ended self.ended_by(tx, e, jobs.len()).await,
                }
            }
            match tx.commit().await {
                Ok(()) => Ended::Committed {
                    wrote: wrote.load(Ordering::Relaxed),
                },
                Err(e) if refused_writes(&e) => Ended::Failed(HandlerError::transient(Refused(e))),
                Err(e) => Ended::CommitFailed(e),
            }
        };
        Ok(Transacted {
            ended,
            had_rows,
            unlocked,
        })
    }

    /// How a transaction ends whose statement after the handlers (of `runs` jobs) failed
    /// with `e`: if an earlier statement had aborted it, which only a handler's failed
    /// statement can have done, the handlers failed (it rolls back); otherwise the database
    /// failed, as at a failed commit.
    async fn ended_by(&self, tx: sqlx::Transaction<'_, DB>, e: sqlx::Error, runs: usize) -> Ended {
        if !is_aborted(&e) {
            return Ended::CommitFailed(e);
        }
        if let Err(rb) = tx.rollback().await {
            tracing::warn!(error = %rb, "rollback failed");
        }
        if runs > 1 {
            self.stats.batch_reruns.add(runs as u64);
        }
        Ended::Failed(HandlerError::transient(Aborted(e)))
    }

    /// Runs the handlers of `jobs` in the open transaction `tx`: for a group of several,
    /// the handler's batch function if it has one, else the handler once per message,
    /// stopping at the first failure. The runs of a group are tentative: if one fails, they
    /// are counted as reruns and every job runs again alone.
    async fn run_handlers(
        &self,
        tx: &mut DB::Connection,
        wrote: &AtomicBool,
        jobs: &mut [Job<H::Message>],
    ) -> Result<Result<(), HandlerError>, Crash> {
        let tentative = jobs.len() > 1;
        // Runs made, to count as reruns if the group fails.
        let mut runs = 0;
        let result = if tentative && self.handler.handles_batches() {
            let mut messages = Vec::with_capacity(jobs.len());
            for job in jobs.iter_mut() {
                match job.take_message() {
                    Ok(m) => messages.push(m),
                    Err(e) => return Ok(Err(no_longer_decodes(e))),
                }
            }
            let members: Vec<BatchMember<'_>> = jobs
                .iter()
                .map(|job| BatchMember {
                    key: job.key(),
                    attempt: job.attempt,
                    delivery: &job.delivery,
                })
                .collect();
            let mut ctx = BatchContext {
                conn: &mut *tx,
                handler: self.inbox.name(),
                members: &members,
                names: self.inbox.names(),
                written: Vec::new(),
                wrote,
            };
            runs = messages.len() as u64;
            self.stats.handler_runs.add(runs);
            self.invoke_batch(&mut ctx, messages).await
        } else {
            let mut result = Ok(());
            for job in jobs.iter_mut() {
                let message = match job.take_message() {
                    Ok(m) => m,
                    Err(e) => {
                        result = Err(no_longer_decodes(e));
                        break;
                    }
                };
                let mut ctx = Context {
                    conn: &mut *tx,
                    handler: self.inbox.name(),
                    key: job.key(),
                    attempt: job.attempt,
                    delivery: &job.delivery,
                    fresh: job.fresh,
                    names: self.inbox.names(),
                    written: Written::default(),
                    wrote,
                    #[cfg(feature = "fault-injection")]
                    faults: self.faults.as_deref(),
                };
                runs += 1;
                result = self.invoke(&mut ctx, message, tentative).await;
                if result.is_err() {
                    break;
                }
            }
            result
        };
        match result {
            Err(e) => {
                if let Some(point) = e.crashed() {
                    return Err(self.crash(point));
                }
                if tentative {
                    tracing::debug!(error = %e, "a handler of the batch failed: the batch runs again one by one");
                    self.stats.batch_reruns.add(runs);
                }
                Ok(Err(e))
            }
            Ok(()) => Ok(Ok(())),
        }
    }

    /// Runs the handler in `ctx`, turning a panic or a timeout into a transient failure.
    /// `tentative`: a batch's run, which is repeated alone if the batch fails, so its panics
    /// and timeouts are counted then, once.
    async fn invoke(
        &self,
        ctx: &mut Context<'_, DB>,
        message: H::Message,
        tentative: bool,
    ) -> Result<(), HandlerError> {
        let timeout = self.settings.timeout;
        self.stats.handler_runs.bump();
        let run = AssertUnwindSafe(self.handler.handle(ctx, message)).catch_unwind();
        let started = std::time::Instant::now();
        let ran = tokio::time::timeout(timeout, run).await;
        self.stats.handler_ran(started.elapsed());
        match ran {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => {
                if !tentative {
                    self.stats.panics.bump();
                }
                Err(HandlerError::transient(format!(
                    "handler panicked: {}",
                    panic_message(&*panic)
                )))
            }
            Err(_) => {
                if !tentative {
                    self.stats.timeouts.bump();
                }
                Err(HandlerError::transient(format!(
                    "handler timed out after {timeout:?}"
                )))
            }
        }
    }

    /// Runs the handler's batch function in `ctx`, turning a panic or a timeout (the
    /// handler's, for the whole batch) into a failure. Always tentative: a failed batch runs
    /// again one message at a time, where panics and timeouts are counted.
    async fn invoke_batch(
        &self,
        ctx: &mut BatchContext<'_, DB>,
        messages: Vec<H::Message>,
    ) -> Result<(), HandlerError> {
        let timeout = self.settings.timeout;
        let run = AssertUnwindSafe(self.handler.handle_batch(ctx, messages)).catch_unwind();
        let started = std::time::Instant::now();
        let ran = tokio::time::timeout(timeout, run).await;
        self.stats.handler_ran(started.elapsed());
        match ran {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(HandlerError::transient(format!(
                "batch function panicked: {}",
                panic_message(&*panic)
            ))),
            Err(_) => Err(HandlerError::transient(format!(
                "batch function timed out after {timeout:?}"
            ))),
        }
    }
}

/// Whether a failed commit refused the handlers' own writes, which only deferred
/// constraints and triggers check at a commit: an integrity constraint violation (SQLSTATE
/// class 23), a data exception (22), a program limit (54) or an error a trigger raised
/// (P0). The handlers' failure, never the inbox refusing a key (the claim or the count
/// before the handlers took it). The database's own failures (a lost connection, a
/// shutdown, a serialization failure) fall in other classes.
fn refused_writes(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| ["22", "23", "54", "P0"].iter().any(|c| code.starts_with(c)))
}

/// The commit refused the handlers' writes (see [`refused_writes`]).
#[derive(Debug, thiserror::Error)]
#[error("the commit refused the handler's writes")]
struct Refused(#[source] sqlx::Error);

/// The handlers returned `Ok`, but a statement of theirs had failed and aborted the
/// transaction (PostgreSQL), so nothing they wrote can commit: the handler's failure.
#[derive(Debug, thiserror::Error)]
#[error(
    "the handler's transaction was aborted by an earlier error it ignored (on PostgreSQL a \
     failed statement aborts the transaction: return the error, or run the statement in a \
     savepoint)"
)]
struct Aborted(#[source] sqlx::Error);

/// A payload that decoded when the job was prepared and no longer does: cannot happen with a
/// deterministic decoder, and no retry would help.
fn no_longer_decodes(e: serde_json::Error) -> HandlerError {
    HandlerError::permanent(format!("the payload no longer decodes: {e}"))
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
