//! Shared by the HTTP tests: `db`, a database per test (a fresh PostgreSQL schema, with or
//! without the Redis fast path, or a temporary SQLite file); `app`, an axum app with the
//! layer served on `127.0.0.1:0` and a reqwest client; `webhook`, the webhook ingress with a
//! worker behind it; and the macros that run a scenario on each database.

// Each test binary uses a part of what is here.
#![allow(dead_code, unreachable_pub, unused_macros)]

mod app;
mod db;
pub mod webhook;

#[allow(unused_imports)]
pub use app::{App, Handlers, Killable, Scoping, ALICE, BOB, CAROL, POLICY_PATH};
#[allow(unused_imports)]
pub use consumer_scenarios::env::{database_url, redis_url, unique, wait_until};
pub use consumer_scenarios::http::Answer;
#[allow(unused_imports)]
pub use db::Db;

macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::common::Db::postgres().await).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::common::Db::sqlite().await).await
                }
            )*
        }
        $crate::common::on_postgres!(postgres_redis: $($name),*);
    };
}

/// The scenarios with the Redis fast path in front of PostgreSQL (a key prefix per test):
/// every answer must be the same as on the database alone.
macro_rules! on_postgres {
    ($module:ident: $($name:ident),* $(,)?) => {
        #[cfg(feature = "redis")]
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::common::Db::postgres_redis().await).await
                }
            )*
        }
    };
}

#[allow(unused_imports)]
pub(crate) use {on_both, on_postgres};
