//! Where the inbox lives: its configuration, the validated table names and the statements
//! rendered on them.

use std::time::Duration;

use crate::ident::Identifier;
use crate::Error;

/// Where the inbox lives, and how long a retry copy may be late.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InboxConfig {
    /// PostgreSQL schema (created if missing). Not supported on SQLite.
    pub schema: Option<String>,
    /// Table name; default `consumer_inbox`.
    pub table: String,
    /// How long past its due time a retry copy may still arrive (default 5 minutes). Until
    /// then an older delivery of the key that comes through the same consumers is superseded
    /// by the copy (acked without running, counted as `superseded`); after it, the copy is
    /// taken as lost (a retry topic past its retention, a retry queue deleted) and such a
    /// delivery runs. Too short costs an attempt (the replay and the copy both run, one after
    /// the other, under the key's lock); too long delays a message whose copy was lost.
    pub copy_grace: Duration,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            schema: None,
            table: "consumer_inbox".to_owned(),
            copy_grace: Duration::from_secs(300),
        }
    }
}

impl InboxConfig {
    /// The default table in `schema`.
    pub fn in_schema(schema: impl Into<String>) -> Self {
        InboxConfig {
            schema: Some(schema.into()),
            ..InboxConfig::default()
        }
    }

    /// The table `table` (in the connection's default schema on PostgreSQL).
    pub fn table(table: impl Into<String>) -> Self {
        InboxConfig {
            table: table.into(),
            ..InboxConfig::default()
        }
    }

    /// The same place with another schema.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The same with another [`InboxConfig::copy_grace`].
    pub fn with_copy_grace(mut self, grace: Duration) -> Self {
        self.copy_grace = grace;
        self
    }
}

/// Validated, quoted names of the inbox objects.
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct TableNames {
    pub(crate) schema: Option<Identifier>,
    /// `"table"`, without its schema.
    bare_table: String,
    /// `"schema"."table"` or `"table"`.
    pub(crate) inbox: String,
    /// `"schema"."table_migrations"`.
    pub(crate) migrations: String,
    /// `"schema"."table_log_marks"` (see [`crate::transport::LogPosition`]).
    pub(crate) log_marks: String,
    /// `"schema"."table_key_templates"`: each handler name's key template (see
    /// `Inbox::check_key_template`).
    pub(crate) key_templates: String,
    /// `"table_expires_at"` (indexes live in the table's schema).
    pub(crate) expires_index: String,
    /// `"table_dead_expires_at"`.
    pub(crate) dead_expires_index: String,
    /// `"table_pending_updated"`: the pending rows by handler and last update, for their
    /// retention.
    pending_index: String,
    /// `"schema"."table_outbox"`: the outbox lives beside its inbox (see [`crate::Outbox`]).
    pub(crate) outbox: String,
    /// `"schema"."table_dead_letters"`: the dead letters of transports without a
    /// dead-letter destination of their own (see
    /// [`crate::transport::Acknowledger::keeps_dead_letters`]).
    pub(crate) dead_letters: String,
    /// `"table_outbox_due"`: the outbox's unpublished rows by id.
    outbox_due_index: String,
    /// `"table_outbox_key"`: its unpublished rows by ordering key and id.
    outbox_key_index: String,
    /// `"table_outbox_sent"`: its published rows by publication time, for the retention.
    outbox_sent_index: String,
    /// `"table_outbox_notify"`: the trigger that wakes the relays (PostgreSQL).
    outbox_notify: String,
    /// `"schema"."table_outbox_notify"`: the trigger's function.
    outbox_notify_fn: String,
    /// Distinguishes this inbox in lock ids: the table as the database resolved it (see
    /// [`Backend::lock_namespace`]), so two spellings of one table take the same locks.
    pub(crate) lock_namespace: String,
    /// [`InboxConfig::copy_grace`].
    pub(crate) copy_grace: Duration,
    /// The former names of the handler a worker's handle serves (see
    /// [`HandlerOptions::alias`](crate::HandlerOptions::alias)): its claims adopt a key's
    /// row found under one of them. Empty everywhere else, and then the claims run their
    /// statements alone.
    pub(crate) aliases: Vec<String>,
    /// The backend's statements on this table, rendered once (see [`Backend::statements`]).
    pub(crate) sql: Statements,
    /// The backend's statements on the outbox, rendered once.
    pub(crate) outbox_sql: OutboxSql,
    /// The backend's statements on the dead-letter table, rendered once.
    pub(crate) dead_letter_sql: DeadLetterSql,
}

/// The inbox statements with the table name filled in, built once per inbox rather than
/// formatted per statement. A backend leaves empty what it does not use.
#[derive(Debug, Clone, Default)]
#[doc(hidden)]
pub struct Statements {
    pub(crate) begin_attempt: String,
    pub(crate) begin_attempts: String,
    pub(crate) select_entries: String,
    pub(crate) fetch_entry: String,
    pub(crate) complete: String,
    pub(crate) complete_and_unlock: String,
    pub(crate) complete_many: String,
    pub(crate) complete_many_and_unlock: String,
    pub(crate) record_failure: String,
    pub(crate) record_retry: String,
    pub(crate) uncount_attempt: String,
    pub(crate) release_dead: String,
    pub(crate) counts: String,
    /// Every handler with rows, and how many (the `counts` row shape, no idle time).
    pub(crate) handlers: String,
    /// Deletes the rows of one status not updated for a while.
    pub(crate) purge_older: String,
    /// Counts them (the `counts` row shape).
    pub(crate) count_older: String,
    pub(crate) purge_expired: String,
    /// Deletes a batch of pending rows that no copy of their message can still reach (see
    /// `Backend::purge_stale_pending`).
    pub(crate) purge_stale_pending: String,
    pub(crate) claim_fresh: String,
    pub(crate) claim_fresh_many: String,
    /// `claim_fresh_many` as a plain insert (PostgreSQL; see `Backend::claim_new_many`).
    pub(crate) claim_new_many: String,
    pub(crate) count_fresh_failure: String,
    /// The keys among `$2` that have a row under one of the handler's aliases `$1` (key,
    /// 0 rows, as `fetch_pairs` reads them).
    pub(crate) alias_keys: String,
    /// Renames the key's row under an alias to the handler's name, unless the handler has
    /// a row for the key (see `flow::adopt`).
    pub(crate) adopt: String,
    /// Creates the (handler, log) mark row if missing, with no mark.
    pub(crate) mark_insert: String,
    /// Reads the mark (PostgreSQL: and locks the row to the end of the transaction).
    pub(crate) mark_select: String,
    /// Raises the mark to at least the bound value.
    pub(crate) mark_update: String,
}

/// The outbox statements of one inbox's table, rendered once.
#[derive(Debug, Clone, Default)]
#[doc(hidden)]
pub struct OutboxSql {
    pub(crate) insert: String,
    /// Inserts lists of rows, in order (PostgreSQL; SQLite inserts them one at a time).
    pub(crate) insert_all: String,
    pub(crate) take: String,
    pub(crate) blockers: String,
    pub(crate) mark_published: String,
    /// Deletes published rows at once (no retention).
    pub(crate) delete_published: String,
    pub(crate) mark_failed: String,
    pub(crate) purge: String,
    pub(crate) stats: String,
    /// Keeps a handler's reply with the request's inbox row.
    pub(crate) store_reply: String,
    /// Writes a key's kept reply to the outbox again, to a given destination.
    pub(crate) resend_reply: String,
}

/// The statements on one inbox's dead-letter table, rendered once.
#[derive(Debug, Clone, Default)]
#[doc(hidden)]
pub struct DeadLetterSql {
    /// Keeps a letter, or counts one more delivery on the row of the same message.
    pub(crate) keep: String,
    /// Every letter, oldest first.
    pub(crate) list: String,
    /// One letter by id.
    pub(crate) fetch: String,
    /// Deletes one letter by id.
    pub(crate) delete: String,
}

impl TableNames {
    pub(super) fn new(config: &InboxConfig) -> Result<Self, Error> {
        let schema = config
            .schema
            .as_deref()
            .map(|s| Identifier::parse("inbox.schema", s))
            .transpose()?;
        let table = Identifier::parse("inbox.table", &config.table)?;
        let qualify = |name: &str| match &schema {
            Some(s) => format!("{}.\"{name}\"", s.quoted()),
            None => format!("\"{name}\""),
        };
        Ok(TableNames {
            bare_table: format!("\"{table}\""),
            inbox: qualify(table.as_str()),
            migrations: qualify(&format!("{table}_migrations")),
            log_marks: qualify(&format!("{table}_log_marks")),
            key_templates: qualify(&format!("{table}_key_templates")),
            expires_index: format!("\"{table}_expires_at\""),
            dead_expires_index: format!("\"{table}_dead_expires_at\""),
            pending_index: format!("\"{table}_pending_updated\""),
            outbox: qualify(&format!("{table}_outbox")),
            dead_letters: qualify(&format!("{table}_dead_letters")),
            outbox_due_index: format!("\"{table}_outbox_due\""),
            outbox_key_index: format!("\"{table}_outbox_key\""),
            outbox_sent_index: format!("\"{table}_outbox_sent\""),
            outbox_notify: format!("\"{table}_outbox_notify\""),
            outbox_notify_fn: qualify(&format!("{table}_outbox_notify")),
            lock_namespace: qualify(table.as_str()),
            copy_grace: config.copy_grace,
            aliases: Vec::new(),
            schema,
            sql: Statements::default(),
            outbox_sql: Default::default(),
            dead_letter_sql: Default::default(),
        })
    }

    /// The table's quoted name without its schema.
    pub(crate) fn unqualified_table(&self) -> &str {
        &self.bare_table
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{inbox}", &self.inbox)
            .replace("{log_marks}", &self.log_marks)
            .replace("{key_templates}", &self.key_templates)
            .replace("{expires_index}", &self.expires_index)
            .replace("{dead_expires_index}", &self.dead_expires_index)
            .replace("{pending_index}", &self.pending_index)
            .replace("{outbox}", &self.outbox)
            .replace("{dead_letters}", &self.dead_letters)
            .replace("{outbox_due_index}", &self.outbox_due_index)
            .replace("{outbox_key_index}", &self.outbox_key_index)
            .replace("{outbox_sent_index}", &self.outbox_sent_index)
            .replace("{outbox_notify}", &self.outbox_notify)
            .replace("{outbox_notify_fn}", &self.outbox_notify_fn)
            .replace(
                "{outbox_rest_lock}",
                &super::locks::OUTBOX_REST_LOCK.to_string(),
            )
            .replace("{copy_grace_ms}", &self.copy_grace_ms().to_string())
    }

    /// [`InboxConfig::copy_grace`] in milliseconds, as the statements compare it.
    pub(crate) fn copy_grace_ms(&self) -> i64 {
        i64::try_from(self.copy_grace.as_millis()).unwrap_or(i64::MAX)
    }
}
