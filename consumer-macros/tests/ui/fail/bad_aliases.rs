use consumer_core::{handler, Context, HandlerError};
use sqlx::Sqlite;

#[derive(serde::Deserialize)]
struct Job {
    id: String,
}

#[handler(aliases = ["old name", "v1", "v1", "charge"])]
async fn charge(_ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    let _ = job.id;
    Ok(())
}

#[handler(aliases = "v1")]
async fn refund(_ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    let _ = job.id;
    Ok(())
}

fn main() {}
