//! Named fault points: crash the worker at an exact moment, to prove that no moment loses or
//! duplicates an effect. Off unless a [`FaultInjector`] is configured; when off, each point
//! costs one branch on an `Option`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A moment in the processing of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultPoint {
    /// The handler ran; its transaction is not committed.
    BeforeCommit,
    /// The transaction committed; the delivery is not settled (acked).
    AfterCommit,
    /// The delivery was settled.
    AfterAck,
}

impl FaultPoint {
    /// A stable name for configuration and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::BeforeCommit => "before_commit",
            FaultPoint::AfterCommit => "after_commit",
            FaultPoint::AfterAck => "after_ack",
        }
    }

    /// Parses [`FaultPoint::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        [
            FaultPoint::BeforeCommit,
            FaultPoint::AfterCommit,
            FaultPoint::AfterAck,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
    }
}

/// What a triggered fault point does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// `std::process::abort()`: the equivalent of `kill -9` at this exact moment.
    Abort,
    /// Stop the whole worker at once, as a crash would, but stay in the process: every
    /// in-flight delivery is dropped unsettled and `run` returns [`crate::Error::Crashed`].
    /// For in-process tests and the quickstart.
    StopWorker,
}

/// Decides, at each fault point, whether to crash.
pub trait FaultInjector: Send + Sync + 'static {
    /// `Some(action)` to crash at `point` while processing `key`.
    fn check(&self, point: FaultPoint, handler: &str, key: &str) -> Option<FaultAction>;
}

/// Crashes once at each listed (point, key) — the first time that key reaches that point.
#[derive(Debug)]
pub struct CrashOnce {
    action: FaultAction,
    pending: Mutex<Vec<(FaultPoint, String)>>,
    fired: AtomicU64,
}

impl CrashOnce {
    /// Crashes with `action` once for each `(point, key)`.
    pub fn new(action: FaultAction, at: impl IntoIterator<Item = (FaultPoint, String)>) -> Self {
        CrashOnce {
            action,
            pending: Mutex::new(at.into_iter().collect()),
            fired: AtomicU64::new(0),
        }
    }

    /// How many crashes fired so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }
}

impl FaultInjector for CrashOnce {
    fn check(&self, point: FaultPoint, _handler: &str, key: &str) -> Option<FaultAction> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let i = pending.iter().position(|(p, k)| *p == point && k == key)?;
        pending.swap_remove(i);
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(self.action)
    }
}

/// Crashes every time `key` reaches `point` (a message that always kills its worker).
#[derive(Debug)]
pub struct CrashAlways {
    /// Where to crash.
    pub point: FaultPoint,
    /// Which key.
    pub key: String,
    /// How.
    pub action: FaultAction,
}

impl FaultInjector for CrashAlways {
    fn check(&self, point: FaultPoint, _handler: &str, key: &str) -> Option<FaultAction> {
        (point == self.point && key == self.key).then_some(self.action)
    }
}
