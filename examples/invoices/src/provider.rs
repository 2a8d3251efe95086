//! A stand-in for an email provider's HTTP API that records every call it receives.
//!
//! A real provider sits outside the handler's transaction: if the transaction rolls back
//! after the call, the email is still sent. The stand-in keeps that property by writing
//! through its own pool, never through the handler's transaction, so `provider_calls`
//! shows every call exactly as the provider would have seen it, duplicates included. Like
//! real email and payment APIs, it takes an idempotency key.
//!
//! Handlers are plain functions whose only per-deployment context is their transaction, so
//! the stand-in is found through the schema that transaction runs in: each worker process
//! (and each test, with its own schema) installs one for its schema at startup. A real
//! application would keep its HTTP client in a global instead.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use consumer_core::ident::Identifier;
use sqlx::PgPool;

/// One email as the provider receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Email {
    /// The recipient.
    pub to: String,
    /// The subject line.
    pub subject: String,
    /// The caller's idempotency key: the same on every attempt for one message.
    pub idempotency_key: String,
}

/// The stand-in provider of one schema.
#[derive(Debug, Clone)]
pub struct EmailProvider {
    pool: PgPool,
    table: String,
}

fn registry() -> &'static Mutex<HashMap<String, EmailProvider>> {
    static PROVIDERS: OnceLock<Mutex<HashMap<String, EmailProvider>>> = OnceLock::new();
    PROVIDERS.get_or_init(Default::default)
}

impl EmailProvider {
    /// Installs the provider for `schema`, writing through `pool` (outside any handler's
    /// transaction).
    pub fn install(schema: &str, pool: PgPool) -> Result<(), consumer_core::Error> {
        let id = Identifier::parse("db.schema", schema)?;
        let provider = EmailProvider {
            pool,
            table: format!("{}.provider_calls", id.quoted()),
        };
        registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(schema.to_owned(), provider);
        Ok(())
    }

    /// The provider installed for `schema`.
    pub fn for_schema(schema: &str) -> Option<EmailProvider> {
        registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(schema)
            .cloned()
    }

    /// Whether a send with `idempotency_key` was already accepted: the lookup an idempotent
    /// API offers (Stripe-style), not itself a send, so not recorded.
    ///
    /// Like such an API, the stand-in serialises requests per key: a lookup waits for a send
    /// with the same key that is still in flight (e.g. from a worker killed mid-request,
    /// whose key lock in the inbox is already released) instead of answering "no" and
    /// letting a second send through.
    pub async fn accepted(&self, idempotency_key: &str) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7))")
            .bind(idempotency_key)
            .execute(&mut *tx)
            .await?;
        let found = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE idempotency_key = $1)",
            self.table
        ))
        .bind(idempotency_key)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(found)
    }

    /// "Sends" `email`: records the call. A real provider would deduplicate on
    /// `idempotency_key`; the stand-in records every send so tests can count them (callers
    /// ask [`EmailProvider::accepted`] first).
    pub async fn send(&self, email: &Email) -> Result<(), sqlx::Error> {
        // Held until the row is committed: see `accepted`.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7))")
            .bind(&email.idempotency_key)
            .execute(&mut *tx)
            .await?;
        sqlx::query(&format!(
            "INSERT INTO {} (idempotency_key, recipient, subject) VALUES ($1, $2, $3)",
            self.table
        ))
        .bind(&email.idempotency_key)
        .bind(&email.to)
        .bind(&email.subject)
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }
}
