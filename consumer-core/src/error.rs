//! Error types of the runtime.

use std::fmt;

/// Errors returned by the runtime, the inbox and configuration checks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid; `field` names it.
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The configuration field, e.g. `inbox.table`.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// The inbox database failed.
    #[error("inbox database error")]
    Database(#[source] sqlx::Error),
    /// A transport failed in a way the runtime cannot recover from.
    #[error("transport error")]
    Transport(#[source] TransportError),
    /// An outgoing message cannot be written or published as it is (an empty destination, a
    /// payload that does not encode).
    #[error("invalid outgoing message: {0}")]
    Message(String),
    /// A fault point stopped the worker on purpose (the `fault-injection` feature: tests,
    /// the chaos suite and the quickstart).
    #[cfg(feature = "fault-injection")]
    #[error("worker crashed at fault point `{0}`")]
    Crashed(&'static str),
}

impl Error {
    /// A database error that says the database could not serve the request just then, not
    /// that the request was wrong: the connection was lost or ended (an I/O error; a
    /// session terminated by an administrator, SQLSTATE 57P01; a server shutting down or
    /// crashed, 57P02; starting up, 57P03; a connection failure, class 08), no connection
    /// slot was free (53300), or the pool timed out waiting for a connection. Worth trying
    /// again once the database is back.
    pub fn is_database_unavailable(&self) -> bool {
        let Error::Database(e) = self else {
            return false;
        };
        match e {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| {
                matches!(code.as_ref(), "57P01" | "57P02" | "57P03" | "53300")
                    || code.starts_with("08")
            }),
            _ => false,
        }
    }

    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            reason: reason.into(),
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}

/// An error reported by a transport: receiving or settling a delivery failed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TransportError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TransportError {
    /// A transport error with a message and no underlying cause.
    pub fn msg(message: impl Into<String>) -> Self {
        TransportError {
            message: message.into(),
            source: None,
        }
    }

    /// A transport error caused by `source`.
    pub fn new(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        TransportError {
            message: message.into(),
            source: Some(source.into()),
        }
    }
}

/// Whether a handler failure may succeed on a later attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Retry with backoff, up to the handler's `max_attempts`.
    Transient,
    /// Never retry: dead-letter at once.
    Permanent,
}

/// The error a handler returns.
///
/// Any `std::error::Error` converts into a *transient* `HandlerError` with `?`, so a database
/// error is retried. Mark errors that no retry can fix with [`HandlerError::permanent`]: the
/// message goes to the dead-letter destination at once.
///
/// Like `anyhow::Error`, this type deliberately does not implement `std::error::Error`, so the
/// blanket conversion does not conflict with `From<T> for T`.
pub struct HandlerError {
    kind: ErrorKind,
    inner: Box<dyn std::error::Error + Send + Sync>,
    /// Set by a fault point inside the handler: the runtime stops as if the process died.
    #[cfg(feature = "fault-injection")]
    crash: Option<crate::fault::point::FaultPoint>,
}

impl HandlerError {
    /// A transient failure: the message will be retried with backoff.
    pub fn transient(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError {
            kind: ErrorKind::Transient,
            inner: error.into(),
            #[cfg(feature = "fault-injection")]
            crash: None,
        }
    }

    /// A permanent failure: the message is dead-lettered without further attempts.
    pub fn permanent(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError {
            kind: ErrorKind::Permanent,
            inner: error.into(),
            #[cfg(feature = "fault-injection")]
            crash: None,
        }
    }

    #[cfg(feature = "fault-injection")]
    pub(crate) fn crash(point: crate::fault::point::FaultPoint) -> Self {
        HandlerError {
            crash: Some(point),
            ..HandlerError::transient(format!("simulated crash at {}", point.as_str()))
        }
    }

    /// The fault point that raised this error to stop the worker, if one did.
    #[inline]
    pub(crate) fn crashed(&self) -> Option<crate::fault::point::FaultPoint> {
        #[cfg(feature = "fault-injection")]
        return self.crash;
        #[cfg(not(feature = "fault-injection"))]
        None
    }

    /// Whether this failure may be retried.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The underlying error.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.inner
    }
}

impl<E> From<E> for HandlerError
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(e: E) -> Self {
        HandlerError::transient(e)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("error", &self.inner)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    /// The error and its chain of sources, `: `-separated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner)?;
        let mut source = self.inner.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}
