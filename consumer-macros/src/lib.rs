//! The `#[handler]` attribute for `consumer-core`, re-exported there as
//! `consumer_core::handler`. Depend on `consumer-core`, not on this crate.
//!
//! The macro turns an `async fn(ctx: &mut Context<'_, DB>, message: M) -> Result<(), E>` into
//! a unit struct of the same name that implements `consumer_core::Handler<DB>`, so a worker
//! can take the function's name as a value: `Worker::new(inbox, send_invoice)`. The original body
//! stays callable as `send_invoice::call(ctx, message)`, e.g. from a unit test.
//!
//! # Layout
//!
//! The macro works in three steps, as `thiserror` does:
//!
//! - `ast` parses the attribute's `key = value` list and the function, syntax only;
//! - `valid` checks both and builds a `valid::Handler`, collecting every error (each
//!   spanned on the offending token) before reporting any: `valid::options` checks the
//!   options, `valid::signature` the function's shape. The grammar of option values (names,
//!   key templates, durations, backoff ranges) is `consumer-options`', which the runtime
//!   checks too, so a value accepted here is never refused when a worker starts;
//! - `expand` generates the struct and the impls. Generated code names only
//!   `::consumer_core::__private` paths and absolute `::core`/`::std` paths, so it does not
//!   depend on what the user has imported.
//!
//! On any error the original function is emitted unchanged next to the `compile_error!`s (as
//! `tokio-macros` does), so an IDE keeps resolving the body while the attribute is wrong.

mod ast;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Makes an `async fn` a message handler.
///
/// ```ignore
/// use consumer_core::{handler, Context, HandlerError};
/// use sqlx::Postgres;
///
/// #[handler(name = "send_invoice", key = "invoice-{order_id}", max_attempts = 5)]
/// async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
///     // write through ctx.db(): it commits with the inbox entry
///     Ok(())
/// }
///
/// let worker = Worker::new(inbox, send_invoice)?;
/// ```
///
/// The function must be `async`, take exactly `(ctx: &mut Context<'_, DB>, message: M)` and
/// return `Result<(), E>` where `E` converts into `HandlerError`. It becomes a unit struct
/// of the same name implementing `Handler<DB>` with `type Message = M`; the body stays
/// callable as `name::call(ctx, message)`.
///
/// # Options
///
/// All optional; anything left out takes `HandlerOptions::new`'s default.
///
/// | option | value | meaning |
/// | --- | --- | --- |
/// | `name` | `"send_invoice"` (letters, digits, `_`, `.`, `-`) | the stable identity stored in the inbox; defaults to the function's name |
/// | `key` | `"invoice-{order_id}"` | key template over the message's fields (`{a.b}` nests, `{{`/`}}` are braces) |
/// | `max_attempts` | `5` (at least 1) | attempts before dead-lettering |
/// | `backoff` | `"200ms..30s"` | exponential backoff from base to cap (base > 0, cap ≥ base) |
/// | `retention` | `"7d"` | how long a completed key is remembered |
/// | `timeout` | `"30s"` (> 0) | longest an attempt may run |
/// | `payload_hash` | `true` / `false` | allow a payload hash as the key when there is no other |
/// | `on_conflict` | `"dead_letter"` / `"skip"` | what to do when a key arrives again with a different payload |
/// | `batch` | `"insert_invoices"` (a path) | a batch function for batched mode (below) |
/// | `aliases` | `["send_invoice_v1"]` (names) | former names: keys completed, dead or pending under them count as this handler's, so a rename runs nothing again |
///
/// Durations are an integer followed by `ms`, `s`, `m`, `h` or `d`.
///
/// # Batch functions
///
/// In batched mode the runtime calls the handler once per message of a batch, inside the
/// batch's one transaction. `batch = "f"` names an
/// `async fn f(ctx: &mut BatchContext<'_, DB>, messages: Vec<M>) -> Result<(), E>` that gets
/// the whole batch instead, so it can write every message's effects with one statement. It
/// must do what the handler would do for each message: if it fails, the batch is rolled back
/// and each message runs alone through the handler, so each gets its own outcome.
#[proc_macro_attribute]
pub fn handler(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::handler(args.into(), item.into()).into()
}
