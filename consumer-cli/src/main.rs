//! `consumer`: the operator's command for workers built on `consumer-core`.
//!
//! ```text
//! consumer migrate
//! consumer inbox stats [--handler H]
//! consumer inbox show HANDLER KEY
//! consumer inbox release HANDLER KEY
//! consumer inbox purge --status dead|completed --older-than 30d [--dry-run]
//! consumer dlq list    --broker amqp|kafka|inbox --queue Q | --topic T
//! consumer dlq show ID --broker ...
//! consumer dlq replay [ID...] [--reason R] [--all] [--dry-run] --broker ...
//!                     [--to EXCHANGE/ROUTING_KEY]     (RabbitMQ)
//! consumer dlq purge  [ID...] [--reason R] [--all] [--dry-run] --broker ...   (or `discard`)
//! consumer outbox stats
//! consumer board [--listen 127.0.0.1:8089] [--allow-actions] --broker ... [--http-table T]
//! ```
//!
//! Every flag can also be given in the environment (`DATABASE_URL`, `DB_SCHEMA`,
//! `INBOX_TABLE`, `AMQP_URL`, `KAFKA_BROKERS`, `DLQ_QUEUE`, `DLQ_TOPIC`, …; `--help` names
//! each), and every command prints JSON with `--json`. Progress goes to stderr, results to
//! stdout. A URL is only ever shown without its credentials, and a setting that does not
//! work (a URL that does not connect, a queue that does not exist) fails naming the setting,
//! with a non-zero exit status.
//!
//! # Replaying safely
//!
//! A replay releases each message's inbox key (`x-handler` + `x-key`, through
//! [`consumer_core::Inbox::release`]) *before* it republishes the message to where it was
//! first published (the framework's `x-original-*` headers), with the attempt count and the
//! old error and dead-letter headers stripped. Then the message is taken out of the
//! dead-letter destination, so a second replay does not find it:
//!
//! - RabbitMQ: the dead letter is acked once the broker confirmed the republished copy.
//! - Kafka: a topic cannot delete a record, so the replay is recorded in a table next to
//!   the inbox (`<inbox table>_dlq_settled`), in the same transaction that is committed after
//!   the delivery report; `list`, `show`, `replay` and `purge` skip recorded records, and
//!   delete the records of those that have left the topic and are older than
//!   `--settled-retention`.
//!
//! On RabbitMQ the origin is used only when the dead letter's signature verifies under
//! `AMQP_ORIGIN_SECRET` (the workers' [`consumer_amqp::OriginSecret`], read from the
//! environment only): a producer can write `x-original-*` itself, and the replay publishes
//! with the operator's credentials. A letter whose origin does not verify stays, with fate
//! `unverified_origin`, until `--to EXCHANGE/ROUTING_KEY` names the destination.
//!
//! A Kafka `copy_too_large` letter holds a reference to its record instead of the record:
//! the replay reads the record at that offset and republishes it, or fails naming the
//! topic, partition and offset when it is gone.
//!
//! If the CLI dies between the republish and that settlement, the next replay republishes
//! the message once more; its key is then `completed` (or `pending` with the first copy), so
//! the inbox treats the second copy as a duplicate and nothing runs twice.
//!
//! The inbox's dead-letter table (`--broker inbox`: the webhook ingress's and the in-memory
//! broker's letters) is read and deleted through [`consumer_core::Inbox`]; a replay posts a
//! webhook letter to the route the operator names, signed with the ingress's secret, and
//! deletes it once the ingress answered that it ran (see `dlq::inbox_table`).
//!
//! # Layout
//!
//! - `main`: the command line ([`clap`] derive) and the dispatch.
//! - `settings`: connecting to the database and the brokers, with errors that name the
//!   setting and never show a credential.
//! - `inbox`: `migrate` and the `inbox` commands.
//! - `outbox`: `outbox stats`, the messages waiting to be published.
//! - `dlq`: the dead-letter commands. `dlq::letter` is what they share whatever the
//!   broker (a dead letter, its error fingerprint, the groups, the selection),
//!   `dlq::report` what a replay or purge did; `dlq::amqp` and `dlq::kafka` read,
//!   republish and settle on each broker, and name the headers a replay strips;
//!   `dlq::reference` reads the record a Kafka `copy_too_large` letter refers to;
//!   `dlq::inbox_table` reads, replays and discards the inbox's dead-letter table.
//! - `board`: `consumer board`, the web page over the same reads and the same safe replay:
//!   `board::args` holds its settings, `board::read` what the pages read from and the
//!   read-only pages, `board::act` the replay and discard (a confirmation, then the
//!   action), `board::page` writes its HTML.
//! - `output`: printing text or JSON.
//!
//! The inbox commands go through [`consumer_core::Inbox`] alone (`counts`, `entry`,
//! `release`, `handlers`, `purge_older`): the inbox's schema has one owner, core.
//! Only PostgreSQL is supported (`DATABASE_URL`); Kafka is reached with
//! `bootstrap.servers` alone (no SASL or TLS settings yet).

mod board;
mod dlq;
mod inbox;
mod outbox;
mod output;
mod settings;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Operate exactly-once consumers: the inbox, the outbox and the dead letters.
#[derive(Debug, Parser)]
#[command(name = "consumer", version, about)]
struct Cli {
    /// Print the result as JSON.
    #[arg(long, global = true, env = "CONSUMER_JSON")]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the inbox and outbox tables (idempotent).
    Migrate(DbArgs),
    /// Look at and repair the inbox.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// List, show, replay and purge dead letters. Boxed: its arguments (each broker's and
    /// the inbox table's) make it several times larger than the other commands.
    #[command(subcommand)]
    Dlq(Box<DlqCommand>),
    /// Look at the outbox beside the inbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Serve a web page over the inbox, the outbox, the dead letters (of the destination
    /// named and of the inbox's table) and the HTTP layer's records (read-only unless --allow-actions; this machine only by
    /// default). Boxed for its size, as `dlq`.
    Board(Box<board::BoardArgs>),
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// Messages waiting to be published, failing, the oldest one's age, and the published
    /// rows the retention keeps.
    Stats {
        #[command(flatten)]
        db: DbArgs,
    },
}

/// Where the inbox lives.
#[derive(Debug, Args, Clone)]
struct DbArgs {
    /// PostgreSQL URL of the inbox database.
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The schema of the inbox table (default: the connection's search path).
    #[arg(long = "schema", env = "DB_SCHEMA")]
    schema: Option<String>,
    /// The inbox table.
    #[arg(
        long = "inbox-table",
        env = "INBOX_TABLE",
        default_value = "consumer_inbox"
    )]
    inbox_table: String,
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// Keys by handler and status, and the stalest pending key.
    Stats {
        #[command(flatten)]
        db: DbArgs,
        /// Only this handler.
        #[arg(long, env = "INBOX_HANDLER")]
        handler: Option<String>,
    },
    /// One key's row.
    Show {
        #[command(flatten)]
        db: DbArgs,
        /// The handler's stable name.
        handler: String,
        /// The key.
        key: String,
    },
    /// Release a dead key, so a replay of its message runs.
    Release {
        #[command(flatten)]
        db: DbArgs,
        /// The handler's stable name.
        handler: String,
        /// The key.
        key: String,
    },
    /// Delete dead or completed rows not updated for a while.
    Purge {
        #[command(flatten)]
        db: DbArgs,
        /// Which rows: `dead` or `completed` (pending rows belong to a delivery).
        #[arg(long, env = "PURGE_STATUS")]
        status: inbox::PurgeStatus,
        /// Only rows not updated for this long: `30d`, `12h`, `15m`, `90s`.
        #[arg(long = "older-than", env = "PURGE_OLDER_THAN", value_parser = inbox::parse_age)]
        older_than: std::time::Duration,
        /// Only count them.
        #[arg(long)]
        dry_run: bool,
    },
}

/// The broker of a dead-letter destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Broker {
    /// RabbitMQ: `--queue` names the dead-letter queue (`<queue>.dlq` by default).
    Amqp,
    /// Kafka: `--topic` names the dead-letter topic (`<topic>.dlq` by default).
    Kafka,
    /// The inbox's dead-letter table (`<inbox table>_dead_letters`), where the webhook
    /// ingress's and the in-memory broker's dead letters are kept: `--database-url` and
    /// `--inbox-table` name it; a replay posts webhook letters to `--replay-url`.
    Inbox,
}

/// The dead-letter destination.
#[derive(Debug, Args, Clone)]
struct DlqArgs {
    /// The broker.
    #[arg(long, env = "DLQ_BROKER")]
    broker: Broker,
    /// RabbitMQ URL.
    #[arg(long = "amqp-url", env = "AMQP_URL", hide_env_values = true)]
    amqp_url: Option<String>,
    /// The dead-letter queue (RabbitMQ).
    #[arg(long, env = "DLQ_QUEUE")]
    queue: Option<String>,
    /// Kafka bootstrap servers.
    #[arg(long = "kafka-brokers", env = "KAFKA_BROKERS")]
    kafka_brokers: Option<String>,
    /// The dead-letter topic (Kafka).
    #[arg(long, env = "DLQ_TOPIC")]
    topic: Option<String>,
    /// Where a replay posts webhook letters (inbox): the application's webhook route,
    /// `http://host:port/webhooks/provider`.
    #[arg(long = "replay-url", env = "DLQ_REPLAY_URL")]
    replay_url: Option<String>,
    /// The secret a replay signs webhook letters with (inbox): one the ingress accepts.
    #[arg(
        long = "webhook-secret",
        env = "WEBHOOK_SECRET",
        hide_env_values = true
    )]
    webhook_secret: Option<String>,
    /// The header a replay puts the signature in (inbox).
    #[arg(
        long = "signature-header",
        env = "WEBHOOK_SIGNATURE_HEADER",
        default_value = "webhook-signature"
    )]
    signature_header: String,
    /// Kafka: how long the record of a replayed or purged dead letter is kept once the
    /// record itself has left the topic (`30d`, `12h`, `15m`, `90s`).
    #[arg(
        long = "settled-retention",
        env = "DLQ_SETTLED_RETENTION",
        default_value = "7d",
        value_parser = inbox::parse_age
    )]
    settled_retention: std::time::Duration,
}

/// Which dead letters a replay or purge takes.
#[derive(Debug, Args, Clone)]
struct Selection {
    /// Message ids (RabbitMQ: the `message_id`; Kafka: `partition/offset`).
    ids: Vec<String>,
    /// Every dead letter with this `x-dead-letter-reason`.
    #[arg(long, env = "DLQ_REASON")]
    reason: Option<String>,
    /// Every dead letter.
    #[arg(long)]
    all: bool,
    /// Say what would be done, change nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// Dead letters grouped by reason and error fingerprint (reads without consuming).
    List {
        #[command(flatten)]
        dlq: DlqArgs,
        /// Kafka only: where replayed and purged records are recorded.
        #[command(flatten)]
        db: DbArgs,
    },
    /// One dead letter in full: properties, headers, payload.
    Show {
        #[command(flatten)]
        dlq: DlqArgs,
        /// Kafka only: where replayed and purged records are recorded.
        #[command(flatten)]
        db: DbArgs,
        /// The message id (Kafka: `partition/offset`).
        id: String,
    },
    /// Release the inbox keys and republish to the original queue or topic.
    Replay {
        #[command(flatten)]
        dlq: DlqArgs,
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        selection: Selection,
        /// RabbitMQ: republish every selected message to this exchange and routing key
        /// (`/QUEUE`: through the default exchange to QUEUE) instead of its origin. Needed
        /// for a message whose origin is not signed with the workers' AMQP_ORIGIN_SECRET.
        #[arg(long, value_name = "EXCHANGE/ROUTING_KEY")]
        to: Option<String>,
    },
    /// Drop dead letters for good.
    #[command(visible_alias = "discard")]
    Purge {
        #[command(flatten)]
        dlq: DlqArgs,
        /// Kafka only: where replayed and purged records are recorded.
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        selection: Selection,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let out = output::Output::new(cli.json);
    match run(cli.command, &out).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out.error(&e);
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, out: &output::Output) -> anyhow::Result<()> {
    match command {
        Command::Migrate(db) => inbox::migrate(&db, out).await,
        Command::Inbox(c) => inbox::run(c, out).await,
        Command::Dlq(c) => dlq::run(*c, out).await,
        Command::Outbox(c) => outbox::run(c, out).await,
        Command::Board(args) => board::run(*args).await,
    }
}
