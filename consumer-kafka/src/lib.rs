//! The kafka transport for consumer-core (work in progress).
