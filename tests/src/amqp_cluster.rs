//! For the RabbitMQ cluster tests: the three-node cluster started by
//! `scripts/rabbitmq.sh cluster 3` (its addresses in `AMQP_CLUSTER_URLS`), which node a
//! consumer is connected to, killing and restarting a node, and reading a queue through any
//! node that is up.

use std::time::Duration;

use consumer_amqp::{AmqpConfig, RedactedUrl};
use lapin::{Connection, ConnectionProperties};

use crate::amqp::{config_at, rabbitmq_sh, ready_on, LONG};

/// The cluster's addresses, comma-separated, as `scripts/rabbitmq.sh cluster 3` prints them.
pub fn cluster_urls() -> String {
    std::env::var("AMQP_CLUSTER_URLS").expect(
        "AMQP_CLUSTER_URLS is not set: start the RabbitMQ cluster with \
         `eval \"$(scripts/rabbitmq.sh cluster 3)\"` (with the same CONSUMER_STATE_DIR as the \
         tests), or run `scripts/test.sh`",
    )
}

/// The test configuration ([`crate::amqp::config`]) on every node of the cluster.
pub fn cluster_config(queue: &str) -> AmqpConfig {
    config_at(&cluster_urls(), queue)
}

/// The node (1-based, as `scripts/rabbitmq.sh node ... I` counts) whose address is `url`.
pub fn node_of(config: &AmqpConfig, url: &RedactedUrl) -> usize {
    config
        .addresses()
        .position(|a| a == url)
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("{url} is not an address of the cluster"))
}

/// `scripts/rabbitmq.sh node <action> <node>`, e.g. `kill` or `start`.
pub async fn node(action: &str, node: usize) {
    rabbitmq_sh(&["node", action, &node.to_string()]).await;
}

/// A node killed with SIGKILL ([`kill_node`]); started again by [`KilledNode::restart`] or,
/// if the test ends first (a failed assertion), when dropped, so the cluster's other tests
/// find it whole.
#[must_use = "the node stays down only while this lives"]
pub struct KilledNode(Option<usize>);

/// Kills node `n` (SIGKILL, `scripts/rabbitmq.sh node kill`).
pub async fn kill_node(n: usize) -> KilledNode {
    node("kill", n).await;
    KilledNode(Some(n))
}

impl KilledNode {
    /// Starts the node again and waits until it has joined the cluster.
    pub async fn restart(mut self) {
        if let Some(n) = self.0.take() {
            node("start", n).await;
        }
    }
}

impl Drop for KilledNode {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            let script = crate::amqp::repo_root().join("scripts/rabbitmq.sh");
            let started = std::process::Command::new(script)
                .args(["node", "start", &n.to_string()])
                .status();
            eprintln!("restarted node {n} of the cluster after the test ended: {started:?}");
        }
    }
}

/// `rabbitmqctl` against node `node`; its standard output.
pub async fn node_ctl(node: usize, args: &[&str]) -> String {
    let node = node.to_string();
    let mut all = vec!["node", "ctl", node.as_str()];
    all.extend_from_slice(args);
    rabbitmq_sh(&all).await
}

/// Messages ready in `queue`, read through the first node that answers (a passive declare).
pub async fn ready_in_cluster(config: &AmqpConfig) -> u32 {
    let start = tokio::time::Instant::now();
    loop {
        for url in config.addresses() {
            let attempt = async {
                let conn =
                    Connection::connect(url.expose(), ConnectionProperties::default()).await?;
                ready_on(conn, &config.queue).await
            };
            match tokio::time::timeout(Duration::from_secs(10), attempt).await {
                Ok(Ok(n)) => return n,
                Ok(Err(e)) => {
                    tracing::info!(%url, error = %e, "count messages: trying the next node")
                }
                Err(_) => tracing::info!(%url, "count messages: no answer; trying the next node"),
            }
        }
        assert!(start.elapsed() < LONG, "no node of the cluster answers");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
