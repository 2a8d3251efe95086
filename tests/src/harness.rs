//! The scenarios' PostgreSQL harness (`consumer-scenarios`' [`Harness`]): a fresh schema
//! per test, several independent pools standing in for several worker processes, and the
//! database faults of the model test: one of the schema's server processes terminated, and
//! chosen jobs' commits failed once by a deferred trigger.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use consumer_core::{BatchConfig, InboxConfig};
use consumer_scenarios::jobs::{bulk_pg, pg_ledger, record_pg};
use consumer_scenarios::{CommitFailure, CommitFaults, DbFault, Harness};
use futures::future::BoxFuture;
use sqlx::Postgres;

use crate::common::PgEnv;

/// A fresh schema with the per-delivery record handler.
pub async fn pg_harness(batch: Option<BatchConfig>) -> Harness<Postgres, record_pg> {
    pg_harness_with(record_pg, batch).await
}

/// A fresh schema with the record handler that has a batch function.
pub async fn pg_bulk_harness(batch: Option<BatchConfig>) -> Harness<Postgres, bulk_pg> {
    pg_harness_with(bulk_pg, batch).await
}

/// A fresh schema with `handler`; each "new process" has a pool of its own.
pub async fn pg_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Postgres, H> {
    let env = Arc::new(PgEnv::new().await);
    Harness {
        handler,
        batch,
        db_fault: Some(terminate_one_backend(env.clone())),
        commit_fault: Some(Arc::new(FailingCommits {
            env: env.clone(),
            armed: AtomicU64::new(0),
        })),
        new_inbox: Box::new({
            let env = env.clone();
            move || {
                let env = env.clone();
                Box::pin(async move { env.inbox().await })
            }
        }),
        other_inbox: Box::new(move |grace| {
            let env = env.clone();
            Box::pin(async move {
                env.inbox_with(InboxConfig::table("consumer_inbox").with_copy_grace(grace))
                    .await
            })
        }),
        ledger: pg_ledger,
        order: |inbox, id, create| {
            Box::pin(async move {
                if create {
                    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                        .bind(id)
                        .execute(inbox.pool())
                        .await
                        .expect("insert order");
                }
                sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("order status")
            })
        },
    }
}

/// Terminates one of the server processes whose connections use `env`'s schema (each of
/// its pools names the schema as its `application_name`), chosen at random; none if there
/// is none.
fn terminate_one_backend(env: Arc<PgEnv>) -> DbFault {
    Arc::new(move || {
        let env = env.clone();
        Box::pin(async move {
            let killer = env.pool(1).await;
            let terminated = sqlx::query_scalar::<_, bool>(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid() \
                 ORDER BY random() LIMIT 1",
            )
            .bind(&env.schema)
            .fetch_optional(&killer)
            .await;
            tracing::info!(?terminated, "model: terminated a backend");
            killer.close().await;
        })
    })
}

/// Fails the next commit that writes each armed job's ledger row, once. A deferred
/// constraint trigger on the ledger checks each row at the commit against the table of
/// armed jobs; each armed job has a sequence of its own, which no rollback undoes, so only
/// its first commit fails: the trigger terminates its own server process (a connection lost
/// at the commit) or raises a serialization failure (SQLSTATE 40001). The trigger is
/// installed by the first arming on the schema.
struct FailingCommits {
    env: Arc<PgEnv>,
    /// Sequences made so far: the next one's number.
    armed: AtomicU64,
}

impl CommitFaults for FailingCommits {
    fn arm(&self, jobs: Vec<(String, CommitFailure)>) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let s = &self.env.schema;
            let pool = self.env.pool(1).await;
            sqlx::raw_sql(&format!(
                "CREATE TABLE IF NOT EXISTS \"{s}\".commit_faults
                   (job_id TEXT PRIMARY KEY, failure TEXT NOT NULL, trips TEXT NOT NULL);
                 CREATE OR REPLACE FUNCTION \"{s}\".commit_fault() RETURNS trigger
                 LANGUAGE plpgsql AS $$
                 DECLARE armed record;
                 BEGIN
                   SELECT failure, trips INTO armed FROM \"{s}\".commit_faults
                    WHERE job_id = NEW.job_id;
                   IF FOUND AND nextval(format('%I.%I', TG_TABLE_SCHEMA, armed.trips)) = 1 THEN
                     IF armed.failure = 'lost_connection' THEN
                       PERFORM pg_terminate_backend(pg_backend_pid());
                     ELSE
                       RAISE EXCEPTION 'the commit of job % failed (model test)', NEW.job_id
                         USING ERRCODE = '40001';
                     END IF;
                   END IF;
                   RETURN NULL;
                 END $$;
                 DROP TRIGGER IF EXISTS commit_fault ON \"{s}\".ledger;
                 CREATE CONSTRAINT TRIGGER commit_fault AFTER INSERT ON \"{s}\".ledger
                   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                   EXECUTE FUNCTION \"{s}\".commit_fault();"
            ))
            .execute(&pool)
            .await
            .expect("install the commit-fault trigger");
            for (job, failure) in jobs {
                let trips = format!(
                    "commit_fault_{}",
                    self.armed.fetch_add(1, Ordering::Relaxed)
                );
                sqlx::raw_sql(&format!("CREATE SEQUENCE \"{s}\".{trips}"))
                    .execute(&pool)
                    .await
                    .expect("create a commit fault's sequence");
                let failure = match failure {
                    CommitFailure::LostConnection => "lost_connection",
                    CommitFailure::SerializationFailure => "serialization_failure",
                };
                sqlx::query(
                    "INSERT INTO commit_faults (job_id, failure, trips) VALUES ($1, $2, $3)",
                )
                .bind(job)
                .bind(failure)
                .bind(trips)
                .execute(&pool)
                .await
                .expect("arm a commit fault");
            }
            pool.close().await;
        })
    }

    /// The armed jobs among `jobs` whose sequence was advanced: the trigger failed a commit.
    fn tripped(&self, jobs: Vec<String>) -> BoxFuture<'_, usize> {
        Box::pin(async move {
            let pool = self.env.pool(1).await;
            let tripped: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM commit_faults f JOIN pg_sequences s \
                   ON s.schemaname = current_schema() AND s.sequencename = f.trips \
                 WHERE f.job_id = ANY($1) AND s.last_value IS NOT NULL",
            )
            .bind(jobs)
            .fetch_one(&pool)
            .await
            .expect("count the commit faults made");
            pool.close().await;
            usize::try_from(tripped).unwrap_or(0)
        })
    }
}
