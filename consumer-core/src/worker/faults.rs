//! The worker's fault points (the chaos suite's, with the `fault-injection` feature): where
//! a simulated crash stops the worker or aborts the process, and the deliberately broken
//! early ack that proves the suite can fail. Without the feature each check is nothing.

use super::job::Job;
use super::{Crash, Inner};
#[cfg(feature = "fault-injection")]
use crate::delivery::Incoming;
use crate::fault::point::FaultPoint;
use crate::handler::Handler;
use crate::inbox::Backend;

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// The keys fault points are checked for, if fault injection is on.
    pub(super) fn fault_keys(&self, jobs: &[Job<H::Message>]) -> Vec<String> {
        #[cfg(feature = "fault-injection")]
        if self.faults.is_some() {
            return jobs.iter().map(|j| j.key().to_owned()).collect();
        }
        let _ = jobs;
        Vec::new()
    }

    /// A simulated crash at `point`: the turns stop first (see [`turn::Turns::stop`]), so
    /// that no job of this worker takes another step while the crash unwinds.
    pub(super) fn crash(&self, point: FaultPoint) -> Crash {
        self.turns.stop();
        Crash(point)
    }

    /// Checks the fault point `point` for `key`: `Err` stops the worker, or the process is
    /// aborted. Without the `fault-injection` feature, nothing.
    #[inline]
    pub(super) fn fault(&self, point: FaultPoint, key: &str) -> Result<(), Crash> {
        #[cfg(feature = "fault-injection")]
        if let Some(faults) = &self.faults {
            match faults.check(point, self.inbox.name(), key) {
                None => {}
                Some(crate::fault::FaultAction::Abort) => {
                    tracing::error!(
                        fault_point = point.as_str(),
                        key,
                        "fault point: aborting the process"
                    );
                    std::process::abort()
                }
                Some(crate::fault::FaultAction::StopWorker) => return Err(self.crash(point)),
            }
        }
        let _ = (point, key);
        Ok(())
    }

    /// DELIBERATELY BROKEN (see `WorkerConfig::broken_ack_before_commit`): acks the
    /// delivery before anything runs, and hands on an acker that settles nothing.
    #[cfg(feature = "fault-injection")]
    pub(super) async fn broken_early_ack(&self, incoming: Incoming) -> Incoming {
        if !self.broken_ack_before_commit {
            return incoming;
        }
        let _ = incoming
            .acker
            .settle(crate::delivery::Settlement::Ack)
            .await;
        Incoming {
            delivery: incoming.delivery,
            acker: Box::new(crate::fault::Settled),
        }
    }
}
