//! The invoice example's workers start into a database that is not ready for them: every
//! connection slot taken (the chaos suite's pool-exhaustion window), or their session
//! terminated midway (its backend terminations, a restart). They wait and try again, as
//! they wait for a server that is starting, instead of exiting. Each test has a database
//! of its own, so the server's other users keep their slots and locks.

use std::time::Duration;

use consumer_tests::common::{database_url, terminate_when_waiting_for_a_lock, unique};
use invoices::settings::Settings;
use sqlx::{Connection as _, PgConnection};

/// A database of the test's own, dropped at the end.
struct OwnDb {
    admin: PgConnection,
    name: String,
    /// Its URL: `DATABASE_URL` with the database replaced.
    url: String,
}

impl OwnDb {
    /// Creates it, with at most `limit` connections when given.
    async fn new(limit: Option<u32>) -> OwnDb {
        let url = database_url();
        let mut admin = PgConnection::connect(&url).await.expect("connect");
        let name = unique("startup");
        let limit = limit.map_or(String::new(), |n| format!(" CONNECTION LIMIT {n}"));
        sqlx::query(&format!("CREATE DATABASE \"{name}\"{limit}"))
            .execute(&mut admin)
            .await
            .expect("create the database");
        let base = url.split_once('?').map_or(url.as_str(), |(base, _)| base);
        let (server, _) = base.rsplit_once('/').expect("a database in DATABASE_URL");
        let url = format!("{server}/{name}");
        OwnDb { admin, name, url }
    }

    async fn drop(mut self) {
        sqlx::query(&format!("DROP DATABASE \"{}\" WITH (FORCE)", self.name))
            .execute(&mut self.admin)
            .await
            .expect("drop the database");
    }
}

/// A worker's settings with `database_url`.
fn worker_settings(database_url: &str) -> Settings {
    Settings::from_lookup(|k| match k {
        "DATABASE_URL" => Some(database_url.to_owned()),
        "AMQP_URL" => Some("amqp://unused/%2f".to_owned()),
        _ => None,
    })
    .expect("settings")
}

/// A worker started while every connection slot is taken (SQLSTATE 53300, "too many
/// connections") keeps trying and starts once the slots free up.
#[tokio::test]
async fn worker_start_waits_for_a_free_connection_slot() {
    /// The database's connection limit: what the worker's start needs at once, and more.
    const SLOTS: u32 = 4;
    let db = OwnDb::new(Some(SLOTS)).await;
    let mut holders = Vec::new();
    for _ in 0..SLOTS {
        holders.push(PgConnection::connect(&db.url).await.expect("take a slot"));
    }
    let settings = worker_settings(&db.url);
    let starting = invoices::app::prepare_db(&settings);
    tokio::pin!(starting);
    // With the only slot taken it keeps waiting (the pool retries the refusal until its
    // acquire timeout, the worker after that until its startup timeout).
    if let Ok(ended) = tokio::time::timeout(Duration::from_secs(2), &mut starting).await {
        panic!(
            "the start ended while no slot was free: {:?}",
            ended.map(|_| "connected")
        );
    }
    for holder in holders {
        holder.close().await.expect("release a slot");
    }
    let (pool, _inbox) = tokio::time::timeout(Duration::from_secs(60), starting)
        .await
        .expect("started within a minute of the slots' release")
        .expect("started");
    pool.close().await;
    db.drop().await;
}

/// A worker whose database session ends while it starts (terminated by an administrator,
/// or the server restarting) tries again instead of exiting: the chaos suite's backend
/// terminations caught workers exiting with "terminating connection due to administrator
/// command" from the inbox's setup. Here the session is terminated while the migration
/// waits for its advisory lock, which the test holds.
#[tokio::test]
async fn worker_start_survives_its_session_being_terminated() {
    const LOCK: &str = "hashtext('invoices example schema')";
    let db = OwnDb::new(None).await;
    let mut locker = PgConnection::connect(&db.url).await.expect("connect");
    sqlx::query(&format!("SELECT pg_advisory_lock({LOCK})"))
        .execute(&mut locker)
        .await
        .expect("take the migration's lock");
    let application = unique("starting");
    let settings = worker_settings(&format!("{}?application_name={application}", db.url));
    let starting = invoices::app::prepare_db(&settings);
    let terminate_it = async {
        // The worker's session waits for the lock: terminate it there.
        terminate_when_waiting_for_a_lock(&mut locker, &application).await;
        sqlx::query(&format!("SELECT pg_advisory_unlock({LOCK})"))
            .execute(&mut locker)
            .await
            .expect("release the lock");
    };
    let (started, ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(starting, terminate_it)
    })
    .await
    .expect("started or failed within a minute");
    let (pool, _inbox) = started.expect("the start tries again after its session was terminated");
    pool.close().await;
    locker.close().await.expect("close");
    db.drop().await;
}
