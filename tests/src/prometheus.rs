//! The Prometheus server that `scripts/prometheus.sh` starts: a test names its worker's
//! metrics address in a target file (file service discovery, scraped every second) with a
//! label of its own, and reads what Prometheus scraped through its HTTP query API.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The server's address and the folder of target files, from `scripts/prometheus.sh env`.
pub struct Prometheus {
    host: String,
    targets: PathBuf,
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: start Prometheus with `eval \"$(scripts/prometheus.sh env)\"`, \
             or run `scripts/test.sh`"
        )
    })
}

impl Prometheus {
    /// The server of `PROMETHEUS_URL` and `PROMETHEUS_TARGETS`.
    pub fn from_env() -> Self {
        let url = var("PROMETHEUS_URL");
        let host = url
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("PROMETHEUS_URL={url} is not an http:// URL"))
            .trim_end_matches('/')
            .to_owned();
        Prometheus {
            host,
            targets: PathBuf::from(var("PROMETHEUS_TARGETS")),
        }
    }

    /// Has `address` scraped, its series labelled `test="{test}"`, until the returned guard
    /// is dropped.
    pub fn scrape(&self, test: &str, address: &str) -> Target {
        let path = self.targets.join(format!("{test}.json"));
        let body = serde_json::json!([{ "targets": [address], "labels": { "test": test } }]);
        // Written aside and renamed: Prometheus never reads a half-written file.
        let tmp = self.targets.join(format!(".{test}.tmp"));
        std::fs::write(&tmp, body.to_string()).expect("write the target file");
        std::fs::rename(&tmp, &path).expect("move the target file into place");
        Target { path }
    }

    /// The value of the instant query `query`, summed over its series; `None` if it has
    /// no series.
    pub async fn value(&self, query: &str) -> Option<f64> {
        let answer = self
            .get(&format!("/api/v1/query?query={}", encode(query)))
            .await;
        let json: serde_json::Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("Prometheus answered {answer:?}: {e}"));
        assert_eq!(json["status"], "success", "{query}: {json}");
        let series = json["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if series.is_empty() {
            return None;
        }
        Some(
            series
                .iter()
                .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                .sum(),
        )
    }

    async fn get(&self, path: &str) -> String {
        let (status, body) = http_get(&self.host, path).await;
        assert_eq!(status, 200, "GET {path} from Prometheus: {body}");
        body
    }
}

/// A GET of `path` from `host` (`address:port`): the status and the body (HTTP/1.0, so the
/// server closes the connection after it).
pub async fn http_get(host: &str, path: &str) -> (u16, String) {
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(host).await?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n");
        conn.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).await?;
        std::io::Result::Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| panic!("{host} answers GET {path} within 10 s"))
        .unwrap_or_else(|e| panic!("GET {path} from {host}: {e}"));
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, body.to_owned())
}

/// A target file; dropping it stops the scrapes.
pub struct Target {
    path: PathBuf,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
