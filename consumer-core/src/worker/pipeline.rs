//! The pipeline over one batch (one delivery in the per-message mode): [`Inner::process`]
//! opens the batch's span and runs its stages. Prepare (a key the batch holds twice is held
//! back by [`RepeatedKeys`], to go through again after the batch), the inbox's judgment of
//! which jobs are fresh, then claim and execute for each group of jobs under one lease of
//! their keys ([`Inner::run_group`]: the fresh jobs together, each job attempted before
//! alone), then settle.

use tracing::{field, Instrument};

use super::claim::{self, Decision};
use super::inner::{Crash, Inner};
use super::job::{self, Job, Verdict};
use super::settle::{settle_all, Settled};
use super::slot::Slot;
use crate::delivery::{DeadLetterReason, Incoming};
use crate::fault::point::FaultPoint;
use crate::handler::Handler;
use crate::inbox::{AttemptItem, Backend, IdMap};

/// The keys of a batch's jobs so far, to find a key that comes twice without copying or
/// hashing each key again: by the key's in-process lock id (see [`Job::lock_id`]), and the job
/// (its index in the batch's jobs) that has it.
struct RepeatedKeys {
    first: IdMap<usize>,
}

impl RepeatedKeys {
    /// For a batch of `jobs` jobs: the table is sized once, not grown as they come.
    fn for_batch(jobs: usize) -> Self {
        RepeatedKeys {
            first: IdMap::with_capacity_and_hasher(jobs, Default::default()),
        }
    }

    /// Whether `job`'s key is one of `jobs`' (the jobs pushed so far, `job` to be pushed next);
    /// if not, it is remembered as the key of the next job.
    fn repeated<M>(&mut self, jobs: &[Job<M>], job: &Job<M>) -> bool {
        match self.first.get(&job.lock_id) {
            Some(&i) if jobs.get(i).is_some_and(|j| j.key() == job.key()) => true,
            // Another key with the same id (rare): compare with every job.
            Some(_) => jobs.iter().any(|j| j.key() == job.key()),
            None => {
                self.first.insert(job.lock_id, jobs.len());
                false
            }
        }
    }
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// The pipeline over one batch (one delivery in the per-message mode): prepare, claim,
    /// execute, settle. `Err` is a simulated crash: nothing of the batch was settled. The
    /// batch holds its `slot` until its outcomes are durable (see [`Slot`]).
    pub(super) async fn process(&self, batch: Vec<Incoming>, slot: Slot) -> Result<(), Crash> {
        let span = if batch.len() == 1 {
            let delivery = &batch[0].delivery;
            let span = tracing::info_span!(
                "delivery",
                otel.kind = "consumer",
                messaging.system = crate::trace::messaging_system(delivery.source.transport),
                messaging.operation.type = "process",
                messaging.message.id = delivery.message_id.as_deref(),
                handler = %self.inbox.name(),
                source = %delivery.source,
                key = field::Empty,
                attempt = field::Empty,
                outcome = field::Empty,
                trace_id = field::Empty,
            );
            crate::trace::join(&span, delivery);
            span
        } else {
            let span = tracing::info_span!(
                "batch",
                otel.kind = "consumer",
                messaging.system = batch
                    .first()
                    .map(|i| crate::trace::messaging_system(i.delivery.source.transport)),
                messaging.operation.type = "process",
                messaging.batch.message_count = batch.len(),
                handler = %self.inbox.name(),
                size = batch.len()
            );
            crate::trace::link(&span, batch.iter().map(|i| &i.delivery));
            span
        };
        self.stages(batch, slot).instrument(span).await
    }

    async fn stages(&self, mut batch: Vec<Incoming>, mut slot: Slot) -> Result<(), Crash> {
        let mut settled: Vec<Settled> = Vec::with_capacity(batch.len());
        let mut jobs: Vec<Job<H::Message>> = Vec::with_capacity(batch.len());
        // A key twice in one batch: the second copy goes through the pipeline (and is
        // counted as received) after the batch, and is then seen as a duplicate.
        let mut repeats = Vec::new();
        let mut seen = (batch.len() > 1).then(|| RepeatedKeys::for_batch(batch.len()));
        let lock_id = |key: &str| self.inbox.local_lock_id(key);
        for incoming in batch.drain(..) {
            #[cfg(feature = "fault-injection")]
            let incoming = self.broken_early_ack(incoming).await;
            if let Some(past) = job::past_retention(&self.settings, &incoming.delivery) {
                self.stats.too_old.bump();
                if self.settings.dead_letter_too_old {
                    let verdict = job::too_old(&self.settings, &incoming.delivery, past);
                    let (delivery, acker) = (&incoming.delivery, incoming.acker);
                    settled.push(self.keep_dead_letter(delivery, acker, verdict));
                    continue;
                }
                tracing::warn!(?past, "a delivery older than the handler's retention runs: its key may have been purged");
            }
            match job::prepare::<H::Message>(&self.settings, incoming, lock_id) {
                Err((incoming, verdict)) => {
                    let (delivery, acker) = (&incoming.delivery, incoming.acker);
                    settled.push(self.keep_dead_letter(delivery, acker, verdict));
                }
                Ok(job) if seen.as_mut().is_some_and(|s| s.repeated(&jobs, &job)) => {
                    repeats.push(job)
                }
                Ok(job) => jobs.push(job),
            }
        }
        self.spare_batches.give_back(batch);
        // Counted once for the batch: what settles here (a repeat is counted when it goes
        // through again).
        self.stats.received.add((settled.len() + jobs.len()) as u64);
        if let [job] = jobs.as_slice() {
            tracing::Span::current().record("key", job.key());
        }
        self.freshness
            .judge(&mut jobs, |j| (&j.delivery, &mut j.fresh))
            .await;
        // Only fault injection needs the keys once the jobs have moved on.
        let fault_keys = self.fault_keys(&jobs);
        // Only the jobs attempted before move out; the fresh ones (usually all) stay put.
        let mut fresh = jobs;
        let counted: Vec<_> = fresh.extract_if(.., |j| !j.fresh).collect();
        let mut alone = Vec::new();
        self.run_group(fresh, true, &mut settled, &mut alone)
            .await?;
        // A job attempted before (redelivered after a crash, a retry copy) runs alone: its
        // attempt is counted and committed before it runs, so a crash in a group would cost
        // every member an attempt, and a message that crashes the worker would get its
        // batch-mates quarantined with it.
        for job in counted {
            self.run_group(vec![job], false, &mut settled, &mut alone)
                .await?;
        }
        // Fresh jobs whose keys had rows (a republished duplicate, say), and the jobs of a
        // statement the inbox refused, now that this batch's locks are released.
        for mut job in alone {
            job.fresh = false;
            job.attempt = job.delivery.attempt;
            self.run_group(vec![job], false, &mut settled, &mut Vec::new())
                .await?;
        }
        if let [one] = settled.as_slice() {
            tracing::Span::current().record("outcome", one.verdict.outcome.as_str());
        }
        // A fault point fires for the batch if it fires for any of its keys.
        for key in &fault_keys {
            self.fault(FaultPoint::AfterCommit, key)?;
        }
        // Settling is the broker's round trip, not the handler's work: the slot goes to the
        // next batch, unless jobs of this one are still to run after it (a repeated key).
        if repeats.is_empty() {
            slot.give_back();
        }
        let results = settle_all(settled).await;
        for (_, result) in &results {
            if let Err(e) = result {
                self.stats.settle_errors.bump();
                tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will deduplicate");
            }
        }
        self.count_all(results.into_iter().map(|(outcome, _)| outcome));
        for key in &fault_keys {
            self.fault(FaultPoint::AfterAck, key)?;
        }
        for job in repeats {
            Box::pin(self.stages(vec![job.into_incoming()], Slot::kept_by_caller())).await?;
        }
        Ok(())
    }

    /// Claims and executes a group of jobs that are all fresh or all counted, under one
    /// lease of their keys.
    async fn run_group(
        &self,
        mut jobs: Vec<Job<H::Message>>,
        fresh: bool,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Job<H::Message>>,
    ) -> Result<(), Crash> {
        if jobs.is_empty() {
            return Ok(());
        }
        let _turn = (self.turns)
            .take(!fresh && jobs.iter().any(|j| j.delivery.redelivered))
            .await;
        let ids = jobs.iter().map(|j| j.lock_id).collect();
        // Only counted jobs take the keys' database locks, with the count of their attempts below.
        let db_keys: Vec<&str> = if fresh {
            Vec::new()
        } else {
            jobs.iter().map(|j| j.key()).collect()
        };
        let mut lease = match self.inbox.lease(ids, &db_keys, &self.kept).await {
            Ok(l) => l,
            Err(e) => {
                self.retry_all_after_db_error(&e, jobs, settled, alone);
                return Ok(());
            }
        };
        if !fresh {
            let claims = {
                let items: Vec<AttemptItem<'_>> = jobs
                    .iter()
                    .map(|j| AttemptItem {
                        key: j.key(),
                        hash: j.hash.as_str(),
                        attempt: j.attempt,
                        scope: j.acker.copy_scope(),
                    })
                    .collect();
                self.inbox.begin_attempts(&mut lease, &items).await
            };
            let claims = match claims {
                Ok(c) => c,
                Err(e) => {
                    lease.spoil();
                    lease.release().await;
                    self.retry_all_after_db_error(&e, jobs, settled, alone);
                    return Ok(());
                }
            };
            let mut to_run = Vec::with_capacity(jobs.len());
            for (mut job, claim) in jobs.into_iter().zip(claims) {
                let (name, on_conflict) = (self.inbox.name(), self.settings.on_conflict);
                match claim::decide(name, &job.delivery, job.key(), claim, on_conflict) {
                    Decision::Run { attempt } => {
                        job.attempt = attempt;
                        to_run.push(job);
                    }
                    Decision::Settle(verdict) => settled.push(self.settled(job, verdict)),
                    Decision::Conflict(verdict) => {
                        // Counted here: its outcome is a dead letter. A skipped conflict is
                        // counted by its outcome.
                        self.stats.conflicts.bump();
                        settled.push(self.settled(job, verdict));
                    }
                    Decision::Quarantine { attempts, error } => {
                        let reason = DeadLetterReason::Quarantined;
                        let (conn, delivery) = (lease.conn(), &job.delivery);
                        let key = job.key();
                        if let Err(verdict) = self
                            .record_failure(conn, delivery, key, Some(reason), &error)
                            .await
                        {
                            settled.push(self.settled(job, verdict));
                            continue;
                        }
                        self.stats.quarantined.bump();
                        let verdict = Verdict::dead_letter(
                            self.inbox.name(),
                            &job.delivery,
                            reason,
                            Some(job.key()),
                            attempts,
                            error,
                        );
                        settled.push(self.settled(job, verdict));
                    }
                }
            }
            jobs = to_run;
        }
        if !jobs.is_empty() {
            if fresh {
                for job in &mut jobs {
                    job.attempt = 1;
                }
            }
            self.execute(&mut lease, jobs, fresh, settled, alone)
                .await?;
        }
        lease.release().await;
        Ok(())
    }
}
