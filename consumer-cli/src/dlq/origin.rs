//! Where a replay sends a RabbitMQ dead letter: the operator's `--to`, else the origin in
//! its `x-original-*` headers once their signature verifies under the workers' origin
//! secret (`AMQP_ORIGIN_SECRET`, [`OriginSecret`]). A producer can write those headers
//! itself; an origin the command cannot verify is not a destination.

use anyhow::{anyhow, bail};
use consumer_amqp::{headers, OriginSecret, ORIGIN_SECRET_VAR};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::report::Fate;

/// Where a replay republishes a message: an exchange (`""`, the default exchange) and a
/// routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Destination {
    pub(super) exchange: String,
    pub(super) routing_key: String,
}

impl Destination {
    /// `--to EXCHANGE/ROUTING_KEY`; `/QUEUE` goes through the default exchange to QUEUE.
    fn parse(to: &str) -> anyhow::Result<Self> {
        let usage = "expected EXCHANGE/ROUTING_KEY (`/QUEUE` for a queue through the default \
                     exchange)";
        let Some((exchange, routing_key)) = to.split_once('/') else {
            bail!("--to {to:?}: {usage}");
        };
        let name = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':');
        if exchange.len() > 255 || !exchange.chars().all(name) {
            bail!("--to {to:?}: the exchange is not a name ([A-Za-z0-9._:-], at most 255)");
        }
        if routing_key.len() > 255 || (exchange.is_empty() && routing_key.is_empty()) {
            bail!("--to {to:?}: {usage}; a routing key has at most 255 bytes");
        }
        Ok(Destination {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }
}

impl std::fmt::Display for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exchange {:?}, routing key {:?}",
            self.exchange, self.routing_key
        )
    }
}

/// How a replay chooses each message's destination: the operator's `--to`, else the
/// message's own origin once its signature verifies.
pub(crate) struct Replay {
    to: Option<Destination>,
    /// From `AMQP_ORIGIN_SECRET`, the workers' own.
    secret: Option<OriginSecret>,
}

impl Replay {
    /// A replay to `to` (`--to`), or to each message's verified origin.
    pub(crate) fn new(to: Option<&str>) -> anyhow::Result<Self> {
        let to = to.map(Destination::parse).transpose()?;
        // The error names the variable and why, never the value.
        let secret = OriginSecret::from_env().map_err(|e| anyhow!("{e}"))?;
        Ok(Replay { to, secret })
    }

    /// Where the dead letter with `properties`, read from `dlq`, goes; else its fate and
    /// why.
    pub(super) fn destination(
        &self,
        properties: &BasicProperties,
        dlq: &str,
    ) -> Result<Destination, (Fate, String)> {
        if let Some(to) = &self.to {
            return Ok(to.clone());
        }
        let name = "name the destination with --to EXCHANGE/ROUTING_KEY";
        let table = properties.headers().as_ref();
        let Some(routing_key) = string_header(table, headers::ORIGINAL_ROUTING_KEY) else {
            let why = format!("no {} header: {name}", headers::ORIGINAL_ROUTING_KEY);
            return Err((Fate::NoOrigin, why));
        };
        let origin = Destination {
            exchange: string_header(table, headers::ORIGINAL_EXCHANGE).unwrap_or_default(),
            routing_key,
        };
        match &self.secret {
            Some(secret) if secret.verifies_dead_letter(dlq, properties) => Ok(origin),
            Some(_) => Err((
                Fate::UnverifiedOrigin,
                format!(
                    "its origin ({origin}) is not signed with {ORIGIN_SECRET_VAR} for {dlq:?}: \
                     a producer may have written it; {name}"
                ),
            )),
            None => Err((
                Fate::UnverifiedOrigin,
                format!(
                    "{ORIGIN_SECRET_VAR} is not set, so its origin ({origin}) cannot be \
                     verified: set it as the workers have it, or {name}"
                ),
            )),
        }
    }
}

/// A string header's value.
pub(super) fn string_header(table: Option<&FieldTable>, name: &str) -> Option<String> {
    match table?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_is_an_exchange_and_a_routing_key() {
        let d = Destination::parse("orders/eu.new").unwrap();
        assert_eq!(
            (d.exchange.as_str(), d.routing_key.as_str()),
            ("orders", "eu.new")
        );
        let d = Destination::parse("/orders").unwrap();
        assert_eq!(
            (d.exchange.as_str(), d.routing_key.as_str()),
            ("", "orders")
        );
        // A routing key may hold `/`; a fanout exchange needs none.
        assert_eq!(Destination::parse("ex/a/b").unwrap().routing_key, "a/b");
        assert_eq!(Destination::parse("fan/").unwrap().routing_key, "");
        for bad in ["orders", "/", "bad exchange/key", ""] {
            let e = Destination::parse(bad).unwrap_err().to_string();
            assert!(e.contains("--to"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn an_unsigned_origin_is_refused_naming_the_way_out() {
        let mut t = FieldTable::default();
        t.insert(
            headers::ORIGINAL_ROUTING_KEY.into(),
            AMQPValue::LongString("victims".into()),
        );
        let p = BasicProperties::default().with_headers(t);
        let secret = OriginSecret::new("cli-unit-test-secret-0123").unwrap();
        let replay = Replay {
            to: None,
            secret: Some(secret),
        };
        let (fate, why) = replay.destination(&p, "q.dlq").unwrap_err();
        assert_eq!(fate, Fate::UnverifiedOrigin);
        assert!(why.contains("--to") && why.contains("victims"), "{why}");
        let without = Replay {
            to: None,
            secret: None,
        };
        let (_, why) = without.destination(&p, "q.dlq").unwrap_err();
        assert!(why.contains(ORIGIN_SECRET_VAR), "{why}");
        let (fate, _) = without
            .destination(&BasicProperties::default(), "q.dlq")
            .unwrap_err();
        assert_eq!(fate, Fate::NoOrigin);
        let named = Replay {
            to: Some(Destination::parse("/q").unwrap()),
            secret: None,
        };
        assert_eq!(named.destination(&p, "q.dlq").unwrap().routing_key, "q");
    }
}
