//! Dead letters kept in the inbox's dead-letter table (`<inbox table>_dead_letters`, beside
//! the inbox): those of the transports with no dead-letter destination of their own, the
//! webhook ingress and the in-memory broker (see
//! [`consumer_core::transport::Acknowledger::keeps_dead_letters`]). Each row keeps the whole
//! message: body bytes, headers, message id, handler, route or queue, reason, error, attempts, and
//! how often the same message was dead-lettered.
//!
//! **Reading.** `list` and `show` read the table through [`consumer_core::Inbox`]; nothing
//! is held or changed. A letter's id is its row id.
//!
//! **Replay.** A webhook letter is posted again to the route of its ingress, at the URL the
//! operator names (`--replay-url`, plain `http://`: the application's own address, since
//! the CLI does not know where it is served): first its dead inbox key is released
//! ([`consumer_core::Inbox::release`]), then its kept body is posted byte for byte with its
//! kept headers, signed now with `WEBHOOK_SECRET` as the provider signs. Answered 200
//! without `dead_lettered`, the ingress's worker has settled the event (ran it, or found it
//! done), and the letter is deleted. Answered otherwise (dead-lettered again, which counts
//! one more delivery on the same letter; a 503; no answer), the letter stays and the
//! replay is reported failed with the answer. A letter of an in-memory queue is not
//! replayed (`no_origin`): that queue lives inside its application, which can replay it
//! itself ([`consumer_core::Inbox::dead_letter`], then `MemoryBroker::publish`).
//!
//! **Purge** (also `discard`) deletes the selected rows.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context as _};
use consumer_core::inbox::StoredDeadLetter;
use consumer_core::Inbox;
use sqlx::Postgres;

use super::letter::DeadLetter;
use super::report::{Done, Fate, Report};
use crate::output::Output;
use crate::settings;
use crate::{DbArgs, DlqArgs, Selection};

/// The transport name of the webhook ingress's letters.
const WEBHOOK: &str = "webhook";

/// Kept headers a replay does not send: the ingress sets the timestamp from the new
/// signature.
const NOT_SENT: &[&str] = &["webhook-timestamp", "content-length", "host"];

/// How long a replayed event may take to be answered.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Every kept dead letter, as the commands show them, with the rows they came from.
async fn read(db: &DbArgs) -> anyhow::Result<(Inbox<Postgres>, Vec<StoredDeadLetter>)> {
    let inbox = settings::inbox(db).await?;
    let rows = inbox
        .dead_letters()
        .await
        .context("read the inbox's dead-letter table")?;
    Ok((inbox, rows))
}

/// Every dead letter of the table, left in it.
pub(super) async fn browse(db: &DbArgs) -> anyhow::Result<Vec<DeadLetter>> {
    let (_, rows) = read(db).await?;
    Ok(rows.iter().map(letter).collect())
}

/// Replays (`replay`) or purges the selected dead letters.
pub(super) async fn settle(
    dlq: &DlqArgs,
    db: &DbArgs,
    selection: &Selection,
    replay: bool,
    out: &Output,
) -> anyhow::Result<Report> {
    let poster = match replay && !selection.dry_run {
        true => Some(Poster::new(dlq)?),
        false => None,
    };
    let (inbox, rows) = read(db).await?;
    let mut done = Vec::new();
    let selected: Vec<&StoredDeadLetter> = rows
        .iter()
        .filter(|row| selection.takes(&letter(row)))
        .collect();
    let total = selected.len();
    for (i, row) in selected.into_iter().enumerate() {
        let mut line = Done {
            id: row.id.to_string(),
            reason: row.reason.clone(),
            fate: Fate::WouldDo,
            key_released: false,
            error: None,
        };
        if replay && row.transport != WEBHOOK {
            line.fate = Fate::NoOrigin;
            line.error = Some(format!(
                "a {} letter cannot be replayed from here: its queue lives in its application",
                row.transport
            ));
        } else if !selection.dry_run {
            let outcome = async {
                if let Some(poster) = &poster {
                    if let Some(key) = &row.key {
                        // Before the post: an event that arrived first would find the key
                        // dead and be dead-lettered again.
                        line.key_released = inbox
                            .release(&row.handler, key)
                            .await
                            .context("release the inbox key")?;
                    }
                    poster.post(row).await?;
                }
                inbox
                    .discard_dead_letter(row.id)
                    .await
                    .context("delete the dead letter")?;
                anyhow::Ok(())
            };
            let outcome = outcome.await;
            line.settle(outcome, if replay { Fate::Replayed } else { Fate::Purged });
        }
        if total > 20 && (i + 1) % 100 == 0 {
            out.progress(&format!("{}/{total}…", i + 1));
        }
        done.push(line);
    }
    Ok(Report::new(selection.dry_run, rows.len(), done))
}

/// Posts webhook letters to the ingress's route, signed as the provider signs.
struct Poster {
    client: reqwest::Client,
    url: String,
    secret: String,
    signature_header: String,
}

impl Poster {
    fn new(dlq: &DlqArgs) -> anyhow::Result<Self> {
        let url = settings::required(&dlq.replay_url, "DLQ_REPLAY_URL (--replay-url)")?;
        if !url.starts_with("http://") {
            bail!(
                "DLQ_REPLAY_URL (--replay-url) must be an http:// URL of the application's \
                 webhook route (the CLI speaks no TLS)"
            );
        }
        let secret = settings::required(&dlq.webhook_secret, "WEBHOOK_SECRET (--webhook-secret)")?;
        let client = reqwest::Client::builder()
            .timeout(ANSWER_WITHIN)
            .build()
            .context("build the HTTP client")?;
        Ok(Poster {
            client,
            url: url.to_owned(),
            secret: secret.to_owned(),
            signature_header: dlq.signature_header.clone(),
        })
    }

    /// Posts `row`'s body; `Ok` once the ingress answered 200 without dead-lettering it.
    async fn post(&self, row: &StoredDeadLetter) -> anyhow::Result<()> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let t = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
        let signature = consumer_http::webhook::sign(self.secret.as_bytes(), t, &row.payload);
        let mut request = self.client.post(&self.url).body(row.payload.clone());
        for (name, value) in &row.headers {
            if !NOT_SENT.contains(&name.as_str()) {
                request = request.header(name.as_str(), value.as_str());
            }
        }
        let answer = request
            .header(self.signature_header.as_str(), signature)
            .send()
            .await
            .map_err(|e| anyhow!("post to DLQ_REPLAY_URL: {}", e.without_url()))?;
        let status = answer.status();
        let body: serde_json::Value = answer.json().await.unwrap_or_default();
        if !status.is_success() {
            bail!("the webhook route answered {status}: {body}");
        }
        if let Some(reason) = body.get("dead_lettered") {
            bail!("dead-lettered again ({reason}); the letter stays, with one more delivery");
        }
        Ok(())
    }
}

/// A kept letter as the commands show it.
fn letter(row: &StoredDeadLetter) -> DeadLetter {
    let at = |t: SystemTime| {
        let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        format!("{ms} (unix ms)")
    };
    let mut properties = BTreeMap::new();
    properties.insert("transport".to_owned(), row.transport.clone());
    properties.insert("location".to_owned(), row.location.clone());
    if let Some(id) = &row.message_id {
        properties.insert("message_id".to_owned(), id.clone());
    }
    properties.insert("attempts".to_owned(), row.attempts.to_string());
    properties.insert("deliveries".to_owned(), row.deliveries.to_string());
    properties.insert("first_dead_lettered".to_owned(), at(row.first_at));
    properties.insert("last_dead_lettered".to_owned(), at(row.last_at));
    DeadLetter {
        id: row.id.to_string(),
        reason: row.reason.clone(),
        handler: Some(row.handler.clone()),
        key: row.key.clone(),
        error: Some(row.error.clone()),
        origin: (row.transport == WEBHOOK).then(|| format!("{WEBHOOK}:{}", row.location)),
        headers: row.headers.clone(),
        properties,
        payload: String::from_utf8_lossy(&row.payload).into_owned(),
    }
}
