//! The crate's error type.

/// Errors of the store and of configuration checks.
///
/// No variant carries a connection string: a database error is kept as the source, and
/// sqlx does not put credentials into the errors it returns for statements.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid; `field` names it.
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The configuration field, e.g. `store.table`.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// The idempotency store's database failed.
    #[error("idempotency store database error")]
    Database(#[source] sqlx::Error),
}

impl Error {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            reason: reason.into(),
        }
    }

    /// A name rejected by [`consumer_core::ident::Identifier::parse`], as this crate's error.
    pub(crate) fn from_core(e: consumer_core::Error) -> Self {
        match e {
            consumer_core::Error::Config { field, reason } => Error::Config { field, reason },
            other => Error::config("store", other.to_string()),
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}
