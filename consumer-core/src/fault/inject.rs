//! The fault injectors: what decides that a fault point fires, and what it then does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::point::FaultPoint;
use crate::delivery::{Acknowledger, Settlement};
use crate::error::TransportError;
use crate::retry::{Jitter, ThreadSafeRng};
use crate::Error;

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

/// The environment variable [`RandomFaults::from_env`] reads: `point=rate` pairs, e.g.
/// `before_commit=0.01,after_commit=0.01,after_ack=0.01,in_effect=0.01` (every
/// [`FaultPoint::ALL`] may be named).
pub const FAULTS_ENV: &str = "CONSUMER_FAULTS";
/// The environment variable with the seed of [`RandomFaults::from_env`] (default: random).
pub const FAULT_SEED_ENV: &str = "CONSUMER_FAULT_SEED";

/// Crashes at each point with a probability: the chaos suite's injector.
#[derive(Debug)]
pub struct RandomFaults {
    rates: Vec<(FaultPoint, f64)>,
    action: FaultAction,
    rng: ThreadSafeRng,
    fired: AtomicU64,
}

impl RandomFaults {
    /// Parses `point=rate,...` (rates in `[0, 1]`); the error names the `faults` field.
    pub fn parse(spec: &str, seed: u64, action: FaultAction) -> Result<Self, Error> {
        let mut rates = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (point, rate) = part
                .split_once('=')
                .ok_or_else(|| Error::config("faults", format!("{part:?} is not `point=rate`")))?;
            let point = FaultPoint::parse(point.trim()).ok_or_else(|| {
                let valid: Vec<&str> = FaultPoint::ALL.iter().map(|p| p.as_str()).collect();
                Error::config(
                    "faults",
                    format!("unknown fault point {point:?}; valid: {}", valid.join(", ")),
                )
            })?;
            let rate: f64 = rate
                .trim()
                .parse()
                .ok()
                .filter(|r: &f64| (0.0..=1.0).contains(r))
                .ok_or_else(|| {
                    Error::config("faults", format!("rate {rate:?} is not in [0, 1]"))
                })?;
            rates.push((point, rate));
        }
        Ok(RandomFaults {
            rates,
            action,
            rng: ThreadSafeRng::seeded(seed),
            fired: AtomicU64::new(0),
        })
    }

    /// From [`FAULTS_ENV`] and [`FAULT_SEED_ENV`], aborting the process when triggered;
    /// `Ok(None)` when the variable is unset or empty.
    pub fn from_env() -> Result<Option<Self>, Error> {
        let Some(spec) = std::env::var(FAULTS_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty())
        else {
            return Ok(None);
        };
        let seed = match std::env::var(FAULT_SEED_ENV) {
            Ok(s) => s
                .trim()
                .parse()
                .map_err(|_| Error::config("fault_seed", format!("{s:?} is not an integer")))?,
            Err(_) => ThreadSafeRng::from_entropy().next_u64(),
        };
        Self::parse(&spec, seed, FaultAction::Abort).map(Some)
    }

    /// How many times a fault fired (only observable with [`FaultAction::StopWorker`]).
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }
}

impl FaultInjector for RandomFaults {
    fn check(&self, point: FaultPoint, _handler: &str, _key: &str) -> Option<FaultAction> {
        let rate = self.rates.iter().find(|(p, _)| *p == point)?.1;
        if rate > 0.0 && self.rng.sample() < rate {
            self.fired.fetch_add(1, Ordering::Relaxed);
            Some(self.action)
        } else {
            None
        }
    }
}

/// The acknowledger left to a delivery that was already acked (the deliberately broken
/// ack-before-commit mode): it settles nothing.
pub(crate) struct Settled;

impl Acknowledger for Settled {
    fn settle(
        self: Box<Self>,
        _settlement: Settlement,
    ) -> futures::future::BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_and_rejects_bad_specs() {
        let f = RandomFaults::parse("before_commit=1, after_ack=0", 1, FaultAction::StopWorker)
            .unwrap();
        assert_eq!(
            f.check(FaultPoint::BeforeCommit, "h", "k"),
            Some(FaultAction::StopWorker)
        );
        assert_eq!(f.check(FaultPoint::AfterAck, "h", "k"), None);
        assert_eq!(f.check(FaultPoint::AfterCommit, "h", "k"), None);
        for bad in [
            "nowhere=0.1",
            "before_commit",
            "before_commit=2",
            "after_ack=x",
        ] {
            let e = RandomFaults::parse(bad, 1, FaultAction::Abort).unwrap_err();
            assert!(e.to_string().contains("faults"), "{e}");
        }
    }

    #[test]
    fn rate_is_roughly_respected_and_seed_reproducible() {
        let run = |seed| {
            let f = RandomFaults::parse("after_commit=0.1", seed, FaultAction::StopWorker).unwrap();
            (0..10_000)
                .map(|_| f.check(FaultPoint::AfterCommit, "h", "k").is_some())
                .collect::<Vec<_>>()
        };
        let a = run(42);
        assert_eq!(a, run(42));
        let hits = a.iter().filter(|h| **h).count();
        assert!((800..1200).contains(&hits), "{hits}");
    }
}
