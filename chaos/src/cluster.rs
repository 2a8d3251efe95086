//! The `cluster` profile's broker fault: a node of the three-node cluster
//! (`scripts/kafka.sh cluster 3`, `scripts/rabbitmq.sh cluster 3`), the leader of the run's
//! jobs partition or queue when it can be found, is SIGKILLed, stays down a few seconds, and
//! is started again; the workers and the runner's clients fail over to the other nodes.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

/// Nodes in the clusters the scripts start.
pub(crate) const NODES: u32 = 3;

/// How long a killed node stays down: longer than the clients' reconnect backoff, so they
/// move to another node, shorter than anything that would time a run out.
const DOWN_FOR: Duration = Duration::from_secs(5);

/// The right to take a node of the cluster that `script` runs down, held until it is up
/// again: runs side by side on one cluster (CI's two Kafka runs) take turns, so the cluster
/// loses one node at a time, the fault its replication (three replicas, two in sync) and
/// its three-voter controller quorum are built to survive. Two nodes down at once is
/// another fault: a CI run saw a restarted node give up its start ("unable to register with
/// the controller quorum") while the other run's node was down, and both runs stall on a
/// cluster left with one node. Released when dropped (an advisory lock on a file named
/// after the script, in the temporary directory).
pub(crate) struct NodeFaultTurn {
    _lock: std::fs::File,
}

/// Waits for [`NodeFaultTurn`] on the cluster of `script`.
pub(crate) async fn node_fault_turn(script: &Path) -> anyhow::Result<NodeFaultTurn> {
    let name = script
        .file_stem()
        .map_or_else(|| "cluster".into(), |s| s.to_string_lossy().into_owned());
    let path = std::env::temp_dir().join(format!("consumer-chaos-{name}-node-fault.lock"));
    let lock = tokio::task::spawn_blocking(move || -> anyhow::Result<std::fs::File> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        file.lock()
            .with_context(|| format!("lock {}", path.display()))?;
        Ok(file)
    })
    .await??;
    Ok(NodeFaultTurn { _lock: lock })
}

/// SIGKILLs node `node` through `script` (`node kill`), keeps it down for [`DOWN_FOR`],
/// then starts it again and waits until it answers (`node start`).
pub(crate) async fn kill_and_restart(script: &Path, node: u32) -> anyhow::Result<()> {
    let n = node.to_string();
    crate::script(script, &["node", "kill", &n]).await?;
    eprintln!("chaos: killed broker node {node}; starting it again in {DOWN_FOR:?}");
    tokio::time::sleep(DOWN_FOR).await;
    crate::script(script, &["node", "start", &n]).await
}

/// The node id of the leader of `topic`'s partition 0, from the metadata of `brokers`
/// (the node ids are the scripts' node numbers); `None` if it cannot be read.
pub(crate) async fn kafka_leader(brokers: &str, topic: &str) -> Option<u32> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("log_level", "3")
            .create()
            .ok()?;
        let metadata = client
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .ok()?;
        let partition = metadata.topics().first()?.partitions().first()?.leader();
        u32::try_from(partition)
            .ok()
            .filter(|n| (1..=NODES).contains(n))
    })
    .await
    .ok()
    .flatten()
}

/// The node number of the leader of quorum queue `queue`, asked of each node in turn with
/// `rabbitmqctl list_queues name leader` (node names are `consumer-cI…@localhost`);
/// `None` if no node answers or the queue is not found.
pub(crate) async fn rabbitmq_leader(script: &Path, queue: &str) -> Option<u32> {
    for asked in 1..=NODES {
        let out = tokio::process::Command::new(script)
            .args(["node", "ctl", &asked.to_string()])
            .args(["list_queues", "name", "leader", "-q", "--no-table-headers"])
            .output()
            .await
            .ok()?;
        if !out.status.success() {
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let leader = text.lines().find_map(|line| {
            let mut parts = line.split_whitespace();
            (parts.next()? == queue).then_some(())?;
            node_number(parts.next()?)
        });
        if leader.is_some() {
            return leader;
        }
    }
    None
}

/// `consumer-c2@localhost` or `consumer-c2-123@localhost` → 2.
fn node_number(node: &str) -> Option<u32> {
    let rest = node.strip_prefix("consumer-c")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|n| (1..=NODES).contains(n))
}

#[cfg(test)]
mod tests {
    use super::node_number;

    #[test]
    fn node_names_give_their_number() {
        assert_eq!(node_number("consumer-c2@localhost"), Some(2));
        assert_eq!(node_number("consumer-c3-4201@localhost"), Some(3));
        assert_eq!(node_number("consumer@localhost"), None);
        assert_eq!(node_number("consumer-c9@localhost"), None);
    }
}
