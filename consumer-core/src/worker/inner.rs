//! What the pipeline's stages share: the worker's [`Inner`] (the handler, its settings, the
//! handler's inbox through which the stages reach the database, counters and the state of
//! its claims and turns), whose stages are written in `pipeline.rs` (prepare and the run of
//! a batch), `execute.rs`, `verdict.rs` and `settle.rs`; and [`Crash`], how a simulated
//! crash stops a delivery.

use std::sync::Arc;

use super::claim::Claims;
use super::config::{BatchConfig, Settings};
use super::spare::SpareBatches;
use super::turn;
use crate::fault::point::FaultPoint;
use crate::handler::Handler;
use crate::inbox::{Backend, HandlerInbox, Kept};
use crate::log_marks::Freshness;
use crate::stats::Stats;

/// What the pipeline's stages share.
pub(super) struct Inner<DB: Backend, H: Handler<DB>> {
    /// The handler's inbox: the worker's only way to the database, also shared with the
    /// acknowledgers that record retries and resend replies.
    pub(super) inbox: HandlerInbox<DB>,
    pub(super) handler: H,
    pub(super) settings: Settings,
    pub(super) concurrency: usize,
    pub(super) batch: Option<BatchConfig>,
    pub(super) retention_interval: Option<std::time::Duration>,
    pub(super) retention_batch: u32,
    pub(super) pending_retention: Option<std::time::Duration>,
    pub(super) inbox_gauge_interval: Option<std::time::Duration>,
    pub(super) stats: Arc<Stats>,
    pub(super) freshness: Freshness<DB>,
    pub(super) turns: turn::Turns,
    /// How batches claim their fresh keys.
    pub(super) claims: Claims,
    /// Emptied batch buffers, for the intake to fill again.
    pub(super) spare_batches: SpareBatches,
    /// The connections the worker's leases released clean, for its next leases.
    pub(super) kept: Arc<Kept<DB>>,
    #[cfg(feature = "fault-injection")]
    pub(super) faults: Option<Arc<dyn crate::fault::FaultInjector>>,
    #[cfg(feature = "fault-injection")]
    pub(super) broken_ack_before_commit: bool,
}

/// Why a delivery's processing stopped without settling: a fault point simulated a crash.
/// Without the `fault-injection` feature nothing constructs it.
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
pub(super) struct Crash(pub(super) FaultPoint);
