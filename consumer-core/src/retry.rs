//! Retry policy: how many attempts, and how long to wait between them.
//!
//! Written here rather than taken from a crate: the `backoff` crate is unmaintained, and
//! iterator- or future-driven retry crates (`backon`) retry a local future in place, while we
//! need a pure function from "attempt n failed" to "redeliver after d". The attempt count comes
//! from the inbox (it survives crashes) and the wait is carried out by the broker (a delayed
//! redelivery), not by a sleeping task. Randomness is injectable so tests are deterministic,
//! as in tower's `retry::backoff`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::Error;

/// A source of uniform samples in `[0, 1]` for jitter.
pub trait Jitter: Send + Sync + 'static {
    /// One sample in `[0, 1]`.
    fn sample(&self) -> f64;
}

/// A small, fast, non-cryptographic generator (SplitMix64), seeded per process.
#[derive(Debug)]
pub(crate) struct ThreadSafeRng(AtomicU64);

impl ThreadSafeRng {
    /// A generator with a fixed seed (reproducible sequences).
    pub(crate) fn seeded(seed: u64) -> Self {
        ThreadSafeRng(AtomicU64::new(seed))
    }

    /// A generator seeded from the process's random state.
    pub(crate) fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default(),
        );
        ThreadSafeRng::seeded(h.finish())
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Jitter for ThreadSafeRng {
    fn sample(&self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// No jitter: every delay is the full exponential ceiling. For tests and for users who want
/// predictable delays.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoJitter;

impl Jitter for NoJitter {
    fn sample(&self) -> f64 {
        1.0
    }
}

/// Exponential backoff with jitter ("equal jitter"): the delay after failed attempt `n` is
/// uniform in `[c/2, c]`, where `c = min(cap, base · 2^(n-1))`.
///
/// Half of each delay is random, which spreads out retries that failed together. The other
/// half is a floor, so an attempt budget means something: `max_attempts` attempts wait at
/// least half the nominal sum of their delays before the message is dead-lettered. With
/// full jitter (uniform in `[0, c]`) the whole budget could by chance be spent in a few
/// seconds: ten attempts at `1s..15s` wait 90 s nominally, about 45 s on average, and less
/// than 25 s for about one message in forty-five (by simulation). Here they wait 45-90 s.
#[derive(Clone)]
pub struct ExponentialBackoff {
    base: Duration,
    cap: Duration,
    jitter: Arc<dyn Jitter>,
}

impl std::fmt::Debug for ExponentialBackoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExponentialBackoff")
            .field("base", &self.base)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl ExponentialBackoff {
    /// A backoff from `base` doubling up to `cap`, jittered by a per-process RNG.
    ///
    /// Fails (naming the `backoff` field) when `base` is zero or `cap < base`.
    pub fn new(base: Duration, cap: Duration) -> Result<Self, Error> {
        consumer_options::BackoffRange::new(base, cap)
            .map_err(|reason| Error::config("backoff", reason.to_string()))?;
        Ok(ExponentialBackoff {
            base,
            cap,
            jitter: Arc::new(ThreadSafeRng::from_entropy()),
        })
    }

    /// Replaces the randomness (e.g. [`NoJitter`] or a seeded `ThreadSafeRng`).
    pub fn with_jitter(mut self, jitter: impl Jitter) -> Self {
        self.jitter = Arc::new(jitter);
        self
    }

    /// The first delay's ceiling.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The largest delay.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The delay before the attempt after failed attempt `failed_attempt` (1-based).
    pub fn next_delay(&self, failed_attempt: u32) -> Duration {
        let exp = failed_attempt.saturating_sub(1).min(32);
        let ceiling = self.base.saturating_mul(1u32 << exp.min(31)).min(self.cap);
        ceiling.mul_f64(0.5 + self.jitter.sample().clamp(0.0, 1.0) / 2.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_without_jitter() {
        let b = ExponentialBackoff::new(Duration::from_millis(100), Duration::from_millis(1000))
            .unwrap()
            .with_jitter(NoJitter);
        let ms: Vec<u128> = (1..=6).map(|n| b.next_delay(n).as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 400, 800, 1000, 1000]);
        assert!(b.next_delay(u32::MAX) <= Duration::from_millis(1000));
    }

    #[test]
    fn jitter_stays_between_half_the_ceiling_and_the_ceiling_and_varies() {
        let b = ExponentialBackoff::new(Duration::from_millis(100), Duration::from_secs(10))
            .unwrap()
            .with_jitter(ThreadSafeRng::seeded(7));
        let samples: Vec<Duration> = (0..200).map(|_| b.next_delay(3)).collect();
        assert!(samples
            .iter()
            .all(|d| (Duration::from_millis(200)..=Duration::from_millis(400)).contains(d)));
        let distinct: std::collections::HashSet<_> = samples.iter().collect();
        assert!(distinct.len() > 100);
    }

    #[test]
    fn invalid_backoff_names_the_field() {
        let e = ExponentialBackoff::new(Duration::ZERO, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("backoff"));
        assert!(ExponentialBackoff::new(Duration::from_secs(2), Duration::from_secs(1)).is_err());
    }
}
