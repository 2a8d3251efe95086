//! What a transport crate (RabbitMQ, Kafka, the in-memory broker, a user's own) uses to hand
//! deliveries to the runtime and settle them.
//!
//! A [`Transport`] is a stream of [`Incoming`] deliveries: each a [`Delivery`] (payload, text
//! [`Headers`], [`MessageId`], attempt number) and the [`Acknowledger`] through which the
//! worker applies its [`Settlement`] once the delivery's outcome is durable. A settlement that
//! is a local step returns [`settled_now`]; a batch's acks can go back together
//! ([`Acknowledger::ack_with`], [`ack_together`], [`downcast_acker`], [`settle_each`],
//! [`AckResults`]); a dead letter goes to the transport as a [`DeadLetter`]. A transport that
//! reads many messages' bytes at once copies them into shared [`Blocks`], which the
//! deliveries' headers and message ids then share.
//!
//! [`Source`] and its [`Location`] say where a delivery came from, for logs and dead letters;
//! [`Origin`] (for a record in a log, its [`LogPosition`]) is what the transport knows of the
//! delivery's past, from which the runtime decides whether it is fresh. A transport's failures
//! are [`TransportError`]s.
//!
//! A handler author needs none of this: the crate's root holds what a handler and the
//! application around it use.

pub use crate::acks::{ack_together, downcast_acker};
pub use crate::blocks::Blocks;
pub use crate::delivery::{
    settle_each, settled_now, AckResults, Acknowledger, DeadLetter, Delivery, Incoming, Location,
    LogPosition, Origin, Settlement, Source, Transport,
};
pub use crate::error::TransportError;
pub use crate::headers::{HeaderIter, Headers};
pub use crate::message_id::MessageId;
