//! The amqp transport for consumer-core (work in progress).
