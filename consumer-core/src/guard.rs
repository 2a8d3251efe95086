//! Guards for effects outside the transaction.
//!
//! A handler whose effect leaves the database (an email, a charge) must make sure a
//! redelivery does not repeat it. Two tools:
//!
//! - A conditional update in the handler's transaction, which exactly one attempt can win:
//!   [`FlagGuard`] (`UPDATE t SET flag = true WHERE id = $1 AND flag = false`) and
//!   [`Transition`] (`UPDATE t SET status = 'sent' WHERE id = $1 AND status = 'created'`).
//! - A stable [`idempotency_key`] to hand to the provider, the same on every attempt, so a
//!   provider that deduplicates (as payment and email APIs do) ignores the repeat that a crash
//!   between the provider call and the commit would otherwise cause.

use crate::handler::Context;
use crate::ident::Identifier;
use crate::inbox::Backend;
use crate::Error;

pub use crate::inbox::backend::GuardValue;

/// A stable idempotency key for `effect` of message `key` in `handler`: 64 hex characters
/// prefixed by `ik-`, the same on every attempt and redelivery.
pub fn idempotency_key(handler: &str, key: &str, effect: &str) -> String {
    crate::key::idempotency_key(handler, key, effect)
}

/// `UPDATE table SET flag = true WHERE id_column = $1 AND flag = false`: sets a boolean flag
/// once. Returns whether this call set it (won), so the effect it guards runs exactly once
/// among all attempts whose transactions commit.
#[derive(Debug, Clone)]
pub struct FlagGuard {
    table: Identifier,
    flag: Identifier,
    id_column: Identifier,
}

impl FlagGuard {
    /// A guard on `table.flag` keyed by `id_column`. The names are validated identifiers.
    pub fn new(table: &str, flag: &str, id_column: &str) -> Result<Self, Error> {
        Ok(FlagGuard {
            table: Identifier::parse("guard.table", table)?,
            flag: Identifier::parse("guard.flag", flag)?,
            id_column: Identifier::parse("guard.id_column", id_column)?,
        })
    }

    /// Sets the flag for row `id` in the handler's transaction; `true` if this call won.
    pub async fn set<DB: Backend>(
        &self,
        ctx: &mut Context<'_, DB>,
        id: impl Into<GuardValue>,
    ) -> Result<bool, Error> {
        let sql = format!(
            "UPDATE {t} SET {f} = true WHERE {c} = {p1} AND {f} = false",
            t = self.table.quoted(),
            f = self.flag.quoted(),
            c = self.id_column.quoted(),
            p1 = DB::placeholder(1),
        );
        let n = DB::execute_guard(ctx.db(), &sql, vec![id.into()]).await?;
        Ok(n == 1)
    }
}

/// `UPDATE table SET state = $to WHERE id_column = $id AND state = $from`: a state transition
/// that exactly one attempt wins.
#[derive(Debug, Clone)]
pub struct Transition {
    table: Identifier,
    state: Identifier,
    id_column: Identifier,
}

impl Transition {
    /// A transition on `table.state_column` keyed by `id_column`.
    pub fn new(table: &str, state_column: &str, id_column: &str) -> Result<Self, Error> {
        Ok(Transition {
            table: Identifier::parse("guard.table", table)?,
            state: Identifier::parse("guard.state_column", state_column)?,
            id_column: Identifier::parse("guard.id_column", id_column)?,
        })
    }

    /// Moves row `id` from state `from` to `to`; `true` if this call made the move.
    pub async fn apply<DB: Backend>(
        &self,
        ctx: &mut Context<'_, DB>,
        id: impl Into<GuardValue>,
        from: &str,
        to: &str,
    ) -> Result<bool, Error> {
        let sql = format!(
            "UPDATE {t} SET {s} = {p1} WHERE {c} = {p2} AND {s} = {p3}",
            t = self.table.quoted(),
            s = self.state.quoted(),
            c = self.id_column.quoted(),
            p1 = DB::placeholder(1),
            p2 = DB::placeholder(2),
            p3 = DB::placeholder(3),
        );
        let args = vec![GuardValue::from(to), id.into(), GuardValue::from(from)];
        let n = DB::execute_guard(ctx.db(), &sql, args).await?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_names_are_validated() {
        assert!(FlagGuard::new("orders", "invoice_sent", "id").is_ok());
        let e = FlagGuard::new("orders; --", "x", "id").unwrap_err();
        assert!(e.to_string().contains("guard.table"));
    }
}
