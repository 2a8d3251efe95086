//! The key template each handler name ran with, recorded beside the inbox: a handler whose
//! template changed while the inbox holds keys made with the old one would run every one of
//! them again (its new keys match none), so the worker is refused at startup instead.

use super::backend::Backend;
use super::dialect::Arg;
use super::handle::Inbox;
use crate::Error;

impl<DB: Backend> Inbox<DB> {
    /// Checks `template` (`""`: the handler has none) against the template recorded for
    /// `handler` and each of its `aliases`, then records it for `handler`. A name whose
    /// recorded template differs and that has rows in the inbox is refused, naming the
    /// handler and both templates, unless `allow_change`. A name with no recorded template
    /// (an inbox older than the record) takes this one.
    pub(crate) async fn check_key_template(
        &self,
        handler: &str,
        aliases: &[String],
        template: &str,
        allow_change: bool,
    ) -> Result<(), Error> {
        let (p1, p2) = (DB::placeholder(1), DB::placeholder(2));
        let recorded = self.names.render(&format!(
            "SELECT template, CAST(0 AS BIGINT) FROM {{key_templates}} WHERE handler = {p1}"
        ));
        let has_keys = self.names.render(&format!(
            "SELECT key, CAST(0 AS BIGINT) FROM {{inbox}} WHERE handler = {p1} LIMIT 1"
        ));
        let mut conn = self.pool.acquire().await?;
        for name in std::iter::once(handler).chain(aliases.iter().map(String::as_str)) {
            let args = [Arg::Text(name)];
            let Some((old, _)) = DB::fetch_pairs(&mut conn, &recorded, &args).await?.pop() else {
                continue;
            };
            if old == template || allow_change {
                continue;
            }
            if !DB::fetch_pairs(&mut conn, &has_keys, &args)
                .await?
                .is_empty()
            {
                return Err(Error::config(
                    "key",
                    format!(
                        "handler `{handler}`: the key template changed from {} to {} while \
                         the inbox holds keys of `{name}` made with the old one, so each of \
                         them would run again; keep the old template, or accept the change \
                         with `WorkerConfig::with_allow_key_template_change(true)`",
                        shown(&old),
                        shown(template)
                    ),
                ));
            }
        }
        let record = self.names.render(&format!(
            "INSERT INTO {{key_templates}} (handler, template) VALUES ({p1}, {p2}) \
             ON CONFLICT (handler) DO UPDATE SET template = excluded.template"
        ));
        DB::execute(
            &mut conn,
            &record,
            &[Arg::Text(handler), Arg::Text(template)],
        )
        .await?;
        Ok(())
    }
}

/// A template as the refusal names it.
fn shown(template: &str) -> String {
    if template.is_empty() {
        "none (the message id)".to_owned()
    } else {
        format!("{template:?}")
    }
}
