//! Where the store lives: [`StoreConfig`], and the validated names and the statements
//! rendered on them.

use consumer_core::ident::Identifier;

use crate::Error;

/// Where the store's table lives. Build one with [`StoreConfig::builder`];
/// [`StoreConfig::default`] is the table `http_idempotency` in the default schema.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StoreConfig {
    schema: Option<Identifier>,
    table: Identifier,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            schema: None,
            table: Identifier::parse("store.table", DEFAULT_TABLE)
                .unwrap_or_else(|_| unreachable!("the default table name is an identifier")),
        }
    }
}

const DEFAULT_TABLE: &str = "http_idempotency";

impl StoreConfig {
    /// A builder: the table `http_idempotency`, no schema.
    pub fn builder() -> StoreConfigBuilder {
        StoreConfigBuilder {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
        }
    }
}

/// Builds a [`StoreConfig`]; [`StoreConfigBuilder::build`] checks the names.
#[derive(Debug, Clone)]
pub struct StoreConfigBuilder {
    schema: Option<String>,
    table: String,
}

impl StoreConfigBuilder {
    /// The PostgreSQL schema, created if missing (not supported on SQLite).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table name (default `http_idempotency`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Checks the names against the identifier pattern; the error names `store.schema` or
    /// `store.table`.
    pub fn build(self) -> Result<StoreConfig, Error> {
        let schema = self
            .schema
            .as_deref()
            .map(|s| Identifier::parse("store.schema", s))
            .transpose()
            .map_err(Error::from_core)?;
        let table = Identifier::parse("store.table", &self.table).map_err(Error::from_core)?;
        Ok(StoreConfig { schema, table })
    }
}

/// The validated, quoted names of the store's objects, and the statements on them.
#[derive(Debug)]
#[doc(hidden)]
pub struct Names {
    pub(crate) schema: Option<Identifier>,
    /// `"schema"."table"` or `"table"`.
    pub(crate) table: String,
    /// `"schema"."table_migrations"`.
    pub(crate) migrations: String,
    /// `"table_expires_at"` (an index lives in its table's schema).
    pub(crate) expires_index: String,
    /// `"schema"."table_operations"`: the long operations requests started.
    pub(crate) operations: String,
    /// `"table_operations_pending"`: the pending operations by kind and age.
    pub(crate) operations_pending_index: String,
    /// `"table_operations_expires_at"`: the finished operations by expiry.
    pub(crate) operations_expires_index: String,
    pub(crate) sql: Statements,
}

/// The statements with the names and the database's clock filled in, built once.
#[derive(Debug, Default)]
#[doc(hidden)]
pub struct Statements {
    pub(crate) claim: String,
    pub(crate) fetch: String,
    pub(crate) complete: String,
    pub(crate) purge: String,
    pub(crate) counts: String,
    /// Starts an operation (pending), in the request's transaction.
    pub(crate) op_insert: String,
    /// One operation by id.
    pub(crate) op_fetch: String,
    /// The oldest pending operations of a kind.
    pub(crate) op_pending: String,
    /// Finishes a pending operation.
    pub(crate) op_finish: String,
    /// Deletes finished operations past their expiry.
    pub(crate) op_purge: String,
}

impl Names {
    /// The names `config` gives, for a database that has schemas or not (`backend` names
    /// it in the error); the statements are left empty.
    pub(crate) fn new(
        config: &StoreConfig,
        has_schemas: bool,
        backend: &str,
    ) -> Result<Self, Error> {
        if config.schema.is_some() && !has_schemas {
            return Err(Error::config(
                "store.schema",
                format!("{backend} has no schemas; leave it unset"),
            ));
        }
        let table = config.table.as_str();
        let qualify = |name: &str| match &config.schema {
            Some(s) => format!("{}.\"{name}\"", s.quoted()),
            None => format!("\"{name}\""),
        };
        Ok(Names {
            schema: config.schema.clone(),
            table: qualify(table),
            migrations: qualify(&format!("{table}_migrations")),
            expires_index: format!("\"{table}_expires_at\""),
            operations: qualify(&format!("{table}_operations")),
            operations_pending_index: format!("\"{table}_operations_pending\""),
            operations_expires_index: format!("\"{table}_operations_expires_at\""),
            sql: Statements::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_the_error_names_the_field() {
        let err = StoreConfig::builder()
            .table("x; DROP TABLE y")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("store.table"), "{err}");
        let err = StoreConfig::builder().schema("a-b").build().unwrap_err();
        assert!(err.to_string().contains("store.schema"), "{err}");
        let with_schema = StoreConfig::builder().schema("s").build().unwrap();
        let err = Names::new(&with_schema, false, "SQLite").unwrap_err();
        assert!(err.to_string().contains("store.schema"), "{err}");
        let pg = Names::new(&with_schema, true, "PostgreSQL").unwrap();
        assert_eq!(pg.table, "\"s\".\"http_idempotency\"");
    }
}
