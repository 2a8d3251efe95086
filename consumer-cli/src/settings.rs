//! Connecting to what the settings name, with errors that name the setting and never show a
//! credential.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail};
use consumer_amqp::RedactedUrl;
use consumer_core::{Inbox, InboxConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, Postgres};

use crate::DbArgs;

/// How long a connection may take before the setting is reported as wrong.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `text` with the user info of `url` (and its password alone) replaced by `***`: a
/// dependency's error may quote what it was given.
pub(crate) fn scrub(text: &str, url: &str) -> String {
    let mut text = text.replace(url, &RedactedUrl::new(url).to_string());
    if let Some((_, rest)) = url.split_once("://") {
        if let Some(at) = rest.rfind('@') {
            let userinfo = &rest[..at];
            let password = userinfo.split_once(':').map(|(_, p)| p).unwrap_or("");
            for secret in [userinfo, password] {
                if !secret.is_empty() {
                    text = text.replace(secret, "***");
                }
            }
        }
    }
    text
}

/// The value of a setting that must be present.
pub(crate) fn required<'a>(value: &'a Option<String>, setting: &str) -> anyhow::Result<&'a str> {
    match value.as_deref().map(str::trim) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => bail!("{setting} is not set"),
    }
}

/// A small pool on `DATABASE_URL`.
pub(crate) async fn pool(db: &DbArgs) -> anyhow::Result<sqlx::PgPool> {
    let url = required(&db.database_url, "DATABASE_URL (--database-url)")?;
    let shown = RedactedUrl::new(url);
    let options = PgConnectOptions::from_str(url).map_err(|e| {
        anyhow!(
            "DATABASE_URL (--database-url) {shown} is not a PostgreSQL URL: {}",
            scrub(&e.to_string(), url)
        )
    })?;
    let cannot = |e: &dyn std::fmt::Display| {
        anyhow!(
            "DATABASE_URL (--database-url) {shown}: cannot connect: {}",
            scrub(&e.to_string(), url)
        )
    };
    // One connection first: a pool only says it timed out, this says why (refused, wrong
    // password, no such database).
    match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
        Ok(Err(e)) => return Err(cannot(&e)),
        Err(_) => return Err(cannot(&format!("no connection within {CONNECT_TIMEOUT:?}"))),
    }
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| cannot(&e))
}

/// The inbox that `db` names (its migrations run, as [`Inbox::new`] always does).
pub(crate) async fn inbox(db: &DbArgs) -> anyhow::Result<Inbox<Postgres>> {
    let pool = pool(db).await?;
    let mut config = InboxConfig::table(db.inbox_table.clone());
    if let Some(schema) = db.schema.as_deref().filter(|s| !s.is_empty()) {
        config = config.with_schema(schema);
    }
    let url = db.database_url.as_deref().unwrap_or_default();
    Inbox::new(pool, config).await.map_err(|e| {
        anyhow!(
            "the inbox (DB_SCHEMA={:?}, INBOX_TABLE={:?}): {}",
            db.schema.as_deref().unwrap_or(""),
            db.inbox_table,
            scrub(&format!("{e}"), url)
        )
    })
}

/// A connection to `AMQP_URL`.
pub(crate) async fn amqp(url: &Option<String>) -> anyhow::Result<lapin::Connection> {
    let url = required(url, "AMQP_URL (--amqp-url)")?;
    let shown = RedactedUrl::new(url);
    let properties =
        lapin::ConnectionProperties::default().with_connection_name("consumer cli".into());
    let connecting = lapin::Connection::connect(url, properties);
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => bail!(
            "AMQP_URL (--amqp-url) {shown}: cannot connect: {}",
            scrub(&e.to_string(), url)
        ),
        Err(_) => bail!("AMQP_URL (--amqp-url) {shown}: no connection within {CONNECT_TIMEOUT:?}"),
    }
}

/// A Kafka client configuration for `KAFKA_BROKERS`.
pub(crate) fn kafka(brokers: &Option<String>) -> anyhow::Result<rdkafka::ClientConfig> {
    let brokers = required(brokers, "KAFKA_BROKERS (--kafka-brokers)")?;
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("socket.timeout.ms", "10000");
    Ok(config)
}

/// `Err` naming `setting` when `value` is not a plain queue or topic name.
pub(crate) fn check_name(setting: &str, value: &str) -> anyhow::Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 249
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if ok {
        Ok(())
    } else {
        bail!("{setting} {value:?} is not a queue or topic name ([A-Za-z0-9._:-], at most 249)")
    }
}
