//! The fault points themselves: named moments, compiled in every build so that the runtime
//! can name them; they fire only with the `fault-injection` feature.
#![cfg_attr(not(feature = "fault-injection"), allow(dead_code, unreachable_pub))]

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
    /// Inside an external effect, after the provider was called but before the handler's
    /// transaction recorded it. Reached only where a handler calls `Context::fault_point`.
    InEffect,
    /// The outbox relay took a row and is about to publish it (the key checked is the row's
    /// message id, the handler `outbox`).
    OutboxBeforePublish,
    /// The broker confirmed a row's publish; the relay has not marked it published.
    OutboxAfterPublish,
}

impl FaultPoint {
    /// A stable name for configuration and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::BeforeCommit => "before_commit",
            FaultPoint::AfterCommit => "after_commit",
            FaultPoint::AfterAck => "after_ack",
            FaultPoint::InEffect => "in_effect",
            FaultPoint::OutboxBeforePublish => "outbox_before_publish",
            FaultPoint::OutboxAfterPublish => "outbox_after_publish",
        }
    }

    /// Every fault point.
    pub const ALL: [FaultPoint; 6] = [
        FaultPoint::BeforeCommit,
        FaultPoint::AfterCommit,
        FaultPoint::AfterAck,
        FaultPoint::InEffect,
        FaultPoint::OutboxBeforePublish,
        FaultPoint::OutboxAfterPublish,
    ];

    /// Parses [`FaultPoint::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        FaultPoint::ALL.into_iter().find(|p| p.as_str() == s)
    }
}
