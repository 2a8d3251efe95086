//! What Redis settled before the database.

use crate::stored::StoredResponse;

/// What Redis settled before the database.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) enum Settled {
    /// The cached answer of this request's fingerprint.
    Replay(StoredResponse),
    /// A cached answer of another fingerprint: 422.
    Mismatch,
    /// The database decides (this request may hold the lease).
    ToDatabase,
}
