//! `--http N`: what the `Idempotency-Key` layer costs a trivial POST, and what the Redis fast
//! path buys. No arm runs; instead, in every repetition, each case serves N requests, from
//! `--concurrency` clients at once, to an axum app on `127.0.0.1:0` whose handler writes one
//! row (the same durable work in every case):
//!
//! - `http: no layer`: the route alone, its row written in a statement of its own;
//! - `http: pg, first`: behind the layer (PostgreSQL store, records scoped by one caller),
//!   every request a new key: the claim, the handler's row and the stored answer;
//! - `http: pg, replay`: the same N keys again: stored answers;
//! - `http: redis+pg, first` and `http: redis+pg, replay`: the same with the Redis fast path
//!   in front (`REDIS_URL`; skipped without it).
//!
//! Each case's rate is requests a second over its wall time, with p50 and p99 latency; the
//! ratios are each case's rate over `no layer`'s in the same repetition. The three setups
//! (no layer, PostgreSQL, Redis + PostgreSQL) take turns going first from one repetition to
//! the next; a setup's replays follow its first requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use consumer_http::{
    IdempotencyConfig, IdempotencyLayer, IdempotencyStore, IdempotentTx, RedisFastPath, StoreConfig,
};
use sqlx::{PgPool, Postgres};

use crate::measure::percentile_ms;
use crate::report::Spread;
use crate::Options;

/// One case's figures in one repetition.
struct Case {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// The cases, in the order they run in a repetition.
const CASES: [&str; 5] = [
    "http: no layer",
    "http: pg, first",
    "http: pg, replay",
    "http: redis+pg, first",
    "http: redis+pg, replay",
];

async fn plain(
    axum::extract::State(pool): axum::extract::State<PgPool>,
    Json(v): Json<serde_json::Value>,
) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
    sqlx::query("INSERT INTO http_effects (n) VALUES ($1)")
        .bind(v["n"].as_i64().unwrap_or_default())
        .execute(&pool)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(v)))
}

async fn layered(
    mut tx: IdempotentTx<Postgres>,
    Json(v): Json<serde_json::Value>,
) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
    sqlx::query("INSERT INTO http_effects (n) VALUES ($1)")
        .bind(v["n"].as_i64().unwrap_or_default())
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// Serves `app` on `127.0.0.1:0`; its base URL.
async fn serve(app: Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

/// `n` POSTs to `url` from `concurrency` clients, keyed `<prefix>-<i>` (no key when `prefix`
/// is `None`); every answer must be 201.
async fn drive(
    client: &reqwest::Client,
    url: &str,
    prefix: Option<&str>,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<Case> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, next) = (client.clone(), url.to_owned(), next.clone());
            let prefix = prefix.map(str::to_owned);
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return Ok::<_, anyhow::Error>(latencies);
                    }
                    let mut request = client.post(&url).json(&serde_json::json!({"n": i}));
                    if let Some(p) = &prefix {
                        request = request.header("Idempotency-Key", format!("{p}-{i}"));
                    }
                    let sent = Instant::now();
                    let status = request.send().await?.status();
                    latencies.push(sent.elapsed().as_micros() as u64);
                    anyhow::ensure!(status == StatusCode::CREATED, "answered {status}");
                }
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(n);
    for t in tasks {
        latencies.extend(t.await??);
    }
    let wall = start.elapsed();
    latencies.sort_unstable();
    Ok(Case {
        rate: n as f64 / wall.as_secs_f64(),
        p50_ms: percentile_ms(&latencies, 0.50),
        p99_ms: percentile_ms(&latencies, 0.99),
    })
}

/// Runs the cases `o.reps` times, `n` requests each, and prints them.
pub(crate) async fn run(pool: &PgPool, o: &Options, n: usize, server: &str) -> anyhow::Result<()> {
    sqlx::query("CREATE TABLE http_effects (n BIGINT NOT NULL)")
        .execute(pool)
        .await?;
    let store_config = StoreConfig::builder().schema("bench").build()?;
    let store = IdempotencyStore::new(pool.clone(), store_config).await?;
    let config = IdempotencyConfig::builder().build()?;
    let redis = match std::env::var("REDIS_URL") {
        Ok(url) => Some(
            RedisFastPath::builder(url)
                .key_prefix(format!("bench-{}", std::process::id()))
                .build()
                .context("REDIS_URL")?,
        ),
        Err(_) => None,
    };
    let plain_url = serve(
        Router::new()
            .route("/p", post(plain))
            .with_state(pool.clone()),
    )
    .await?;
    // Scoped by caller, as a service must be: one caller, since the cost of naming it and
    // hashing its name is the same for any.
    let layer = || {
        IdempotencyLayer::builder(store.clone(), config.clone())
            .caller(|_| Some("bench".to_owned()))
    };
    let pg_url = serve(
        Router::new()
            .route("/p", post(layered))
            .layer(layer().build()),
    )
    .await?;
    let redis_url = match &redis {
        Some(fast) => Some(
            serve(
                Router::new()
                    .route("/p", post(layered))
                    .layer(layer().redis(fast.clone()).build()),
            )
            .await?,
        ),
        None => None,
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(o.concurrency)
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut figures: Vec<Vec<Case>> = CASES.iter().map(|_| Vec::new()).collect();
    for rep in 0..o.reps {
        eprintln!("repetition {rep}");
        let c = o.concurrency;
        let url = |base: &str| format!("{base}/p");
        // The three setups take turns going first, so that a warm-up or a drift of the
        // machine weighs on each alike.
        for block in (0..3).map(|b| (b + rep) % 3) {
            match block {
                0 => figures[0].push(drive(&client, &url(&plain_url), None, n, c).await?),
                1 => {
                    let keys = format!("pg{rep}");
                    figures[1].push(drive(&client, &url(&pg_url), Some(&keys), n, c).await?);
                    figures[2].push(drive(&client, &url(&pg_url), Some(&keys), n, c).await?);
                }
                _ => {
                    if let Some(base) = &redis_url {
                        let keys = format!("redis{rep}");
                        figures[3].push(drive(&client, &url(base), Some(&keys), n, c).await?);
                        figures[4].push(drive(&client, &url(base), Some(&keys), n, c).await?);
                    }
                }
            }
        }
    }
    println!(
        "\n{n} requests a case, {} repetitions (median [min, max]), concurrency {}; {server}\n",
        o.reps, o.concurrency
    );
    println!(
        "{:<26} {:>24} {:>8} {:>8}",
        "case", "req/s [min, max]", "p50 ms", "p99 ms"
    );
    for (name, cases) in CASES.iter().zip(&figures) {
        // A case that did not run (no REDIS_URL) has no values, so no spread.
        let of = |figure: fn(&Case) -> f64| Spread::of(cases.iter().map(figure).collect());
        let (Some(rate), Some(p50), Some(p99)) =
            (of(|c| c.rate), of(|c| c.p50_ms), of(|c| c.p99_ms))
        else {
            continue;
        };
        println!(
            "{name:<26} {:>24} {:>8.2} {:>8.2}",
            format!("{rate:.0}"),
            p50.median,
            p99.median
        );
    }
    println!("\nratio to `http: no layer`, same repetition: median [min, max]");
    for (name, cases) in CASES.iter().zip(&figures).skip(1) {
        let ratios = cases
            .iter()
            .zip(&figures[0])
            .map(|(c, base)| c.rate / base.rate)
            .collect();
        let Some(ratio) = Spread::of(ratios) else {
            continue;
        };
        println!("{name:<26} = {ratio:.2}");
    }
    Ok(())
}
