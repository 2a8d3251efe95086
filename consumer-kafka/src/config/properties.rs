//! [`ClientProperties`]: librdkafka properties passed through as given, credentials
//! redacted from their `Debug` output.

use std::collections::BTreeMap;
use std::fmt;

use rdkafka::config::ClientConfig;

/// librdkafka client properties (`name = value`), passed through as given.
///
/// Its `Debug` output redacts the values of credentials (`sasl.password`,
/// `ssl.key.password`, anything containing `password`, `secret`, `jaas`, `token`, or a PEM
/// key), so a logged configuration never leaks them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClientProperties {
    map: BTreeMap<String, String>,
}

impl ClientProperties {
    /// No properties.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `name` to `value`, replacing an earlier value.
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.map.insert(name.into(), value.into());
        self
    }

    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.map.get(name).map(String::as_str)
    }

    /// Removes `name`.
    pub fn remove(&mut self, name: &str) -> Option<String> {
        self.map.remove(name)
    }

    /// Every property, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.map.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// No property is set.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether the value of `name` is a credential that must never be shown.
    pub fn is_sensitive(name: &str) -> bool {
        let n = name.to_ascii_lowercase();
        [
            "password", "secret", "jaas", "token", "key.pem", "ssl_key", "ssl.key",
        ]
        .iter()
        .any(|s| n.contains(s))
            || n == "sasl.oauthbearer.config"
    }

    pub(super) fn apply(&self, config: &mut ClientConfig) {
        for (k, v) in &self.map {
            config.set(k, v);
        }
    }
}

impl fmt::Debug for ClientProperties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.map.iter().map(|(k, v)| {
                let shown = if ClientProperties::is_sensitive(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k, shown)
            }))
            .finish()
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for ClientProperties {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        ClientProperties {
            map: iter
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }
}
