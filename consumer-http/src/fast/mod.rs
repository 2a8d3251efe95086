//! The Redis fast path: cached answers and a lease in Redis, in front of the store (see the
//! crate doc's [Redis fast path](crate#redis-fast-path)).
//!
//! - `path` (feature `redis`): [`RedisFastPath`], its builder, and [`FastRequest`]: one
//!   request's keys, lease and calls.
//! - `entry` (feature `redis`): a cached answer's encoding.
//! - `settled`: what Redis settled before the database.
//!
//! Without the feature, [`FastRequest`] is an empty type: the layer never has one, and
//! its flow reads the same.

#[cfg(feature = "redis")]
mod entry;
#[cfg(feature = "redis")]
mod path;

#[cfg(feature = "redis")]
pub(crate) use path::FastRequest;
#[cfg(feature = "redis")]
pub use path::{RedisFastPath, RedisFastPathBuilder};

mod settled;

#[cfg(not(feature = "redis"))]
use crate::stored::StoredResponse;
pub(crate) use settled::Settled;

/// Without the `redis` feature: no request has a fast path.
#[cfg(not(feature = "redis"))]
pub(crate) enum FastRequest {}

#[cfg(not(feature = "redis"))]
impl FastRequest {
    pub(crate) async fn settle(&self, _: tokio::time::Instant, _: std::time::Duration) -> Settled {
        match *self {}
    }

    pub(crate) async fn publish(&self, _: &StoredResponse, _: tokio::time::Instant) {
        match *self {}
    }

    pub(crate) async fn hold_while<F: std::future::Future>(&self, _: F) -> F::Output {
        match *self {}
    }

    pub(crate) async fn release(&self) {
        match *self {}
    }
}
