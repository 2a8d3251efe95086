//! The grammar of the `#[handler]` options, in one place.
//!
//! `consumer-macros` checks an option's value when the attribute is compiled and
//! `consumer-core` checks the same value when a worker starts (options built by hand with
//! `HandlerOptions` never meet the macro). Both call this crate, so a value the macro accepts
//! is never refused at run time, and both report a bad value with the same message.
//!
//! Every check is a plain function from a value to the parsed form or an [`OptionError`];
//! its `Display` is the message users see. The caller adds where the value came from: the
//! macro puts the message on the literal's span, the runtime names the option.
//!
//! ```
//! use std::time::Duration;
//!
//! use consumer_options::{parse_duration, parse_key_template, BackoffRange, Segment};
//!
//! assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
//! assert_eq!(
//!     parse_key_template("invoice-{order_id}"),
//!     Ok(vec![
//!         Segment::Literal("invoice-".to_owned()),
//!         Segment::Field(vec!["order_id".to_owned()]),
//!     ])
//! );
//! let backoff = BackoffRange::parse("200ms..30s").expect("a valid range");
//! assert_eq!(backoff.cap(), Duration::from_secs(30));
//! assert!(consumer_options::check_handler_name("send invoice").is_err());
//! ```
//!
//! # Layout
//!
//! - `name`: the handler name rule, [`check_handler_name`].
//! - `key`: key templates, parsed into [`Segment`]s by [`parse_key_template`]; rendering a key
//!   from a message is the runtime's business.
//! - `duration`: [`parse_duration`] and [`format_duration`], the `"30s"` form.
//! - `backoff`: [`BackoffRange`], a base and a cap that satisfy the bounds rule.
//! - `error`: [`OptionError`], one variant per way a value can be wrong.
//!
//! The crate has no dependencies, so the proc-macro can use it without building the
//! runtime's.

#![forbid(unsafe_code)]

mod backoff;
mod duration;
mod error;
mod key;
mod name;

pub use backoff::BackoffRange;
pub use duration::{format_duration, parse_duration};
pub use error::OptionError;
pub use key::{parse_key_template, Segment};
pub use name::check_handler_name;
