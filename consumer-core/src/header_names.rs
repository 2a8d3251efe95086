//! The names of the headers the framework itself reads and writes, the same on every
//! transport: the attempt number of a retry copy, what a dead letter says about itself, and
//! a request's reply address and correlation id. Each transport re-exports the retry and
//! dead-letter names in its own `headers` module beside the names only it uses (RabbitMQ's
//! origin and retry-due headers, Kafka's original topic, partition and offset).

/// The attempt number of a retry copy (the first delivery, without it, is attempt 1);
/// becomes [`Delivery::attempt`](crate::transport::Delivery::attempt).
pub const ATTEMPT: &str = "x-attempt";
/// When the message first failed (written on the first retry copy and kept afterwards, by
/// the transports that track it).
pub const FIRST_FAILURE: &str = "x-first-failure";
/// Why a message was dead-lettered: a [`DeadLetterReason`](crate::DeadLetterReason) name
/// such as `undecodable` or `max_attempts_exceeded`.
pub const DEAD_LETTER_REASON: &str = "x-dead-letter-reason";
/// The stable name of the handler that dead-lettered the message.
pub const HANDLER: &str = "x-handler";
/// The idempotency key, when one was derived (absent otherwise).
pub const KEY: &str = "x-key";
/// Attempts counted by the inbox (0 when the handler never ran).
pub const ATTEMPTS: &str = "x-attempts";
/// The last error's text (at most [`MAX_ERROR_LEN`] bytes).
pub const ERROR: &str = "x-error";

/// Longest error text put in a header; longer texts are cut at a character boundary and
/// end in `…`. An error can be as long as a handler makes it; its copy must still fit.
pub const MAX_ERROR_LEN: usize = 4096;

/// The delivery header naming where a request's reply goes (a queue, a topic): RabbitMQ's
/// `reply_to` property, a Kafka header of this name. See
/// [`Context::reply`](crate::Context::reply).
pub const REPLY_TO: &str = "reply-to";

/// The delivery header carrying a request's correlation id (RabbitMQ's `correlation_id`
/// property, a Kafka header of this name); a reply carries it back.
pub const CORRELATION_ID: &str = "correlation-id";
