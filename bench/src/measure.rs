//! What an arm's figures are measured with ([`Figures`]): its [`Clock`] (wall time and this
//! process's CPU time, started just before its first message and stopped after its last),
//! this process's RSS and the local servers' CPU time read on both sides of it
//! ([`Baseline`]), and the quantiles of its delivery-to-ack latencies (which `timing`
//! records). Also `--thread-cpu`'s CPU time by thread ([`THREAD_CPU`]) and the
//! `--perf-ctl` FIFO ([`PERF_CTL`]) that limits a profile to the arms' clocks.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One arm's figures from one repetition.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct Figures {
    /// Messages a second over the arm's wall time.
    pub(crate) rate: f64,
    /// This process's CPU time per message, in µs.
    pub(crate) cpu_us_per_msg: f64,
    /// The median delivery-to-ack latency, in ms (0 if none was recorded).
    pub(crate) p50_ms: f64,
    /// The 99th percentile of the delivery-to-ack latency, in ms (0 if none was recorded).
    pub(crate) p99_ms: f64,
    /// How much this process's RSS grew over the arm, in MiB.
    pub(crate) rss_mib: f64,
    /// CPU time of the PostgreSQL server processes per message (all of them: backends,
    /// WAL writer, checkpointer), if readable.
    pub(crate) server_us_per_msg: f64,
    /// CPU time of the broker processes (RabbitMQ's `beam.smp`, Kafka's `java`) per message.
    pub(crate) broker_us_per_msg: f64,
    /// Whether the arm recorded delivery-to-ack latencies (`p50_ms` and `p99_ms` are theirs).
    pub(crate) measured_latency: bool,
    /// The `+ outbox` arms': how fast they consumed, and how long the relay took after.
    #[serde(default)]
    pub(crate) relay: Option<RelayFigures>,
}

/// The relay's part of an `+ outbox` arm's figures.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct RelayFigures {
    /// Messages consumed (acked) a second: the arm's rate up to its last ack.
    pub(crate) consumed_rate: f64,
    /// How long after the last ack the broker confirmed the last event, in ms (negative: the
    /// last event was relayed before the last ack).
    pub(crate) tail_ms: f64,
    /// The share of the events the broker had confirmed at the last ack.
    pub(crate) relayed_at_ack: f64,
}

/// `--thread-cpu`: every live thread's CPU time when the running arm's clock started and when
/// its CPU time was read ([`cpu_since`]); `None` without the flag.
pub(crate) static THREAD_CPU: Mutex<Option<ThreadTimes>> = Mutex::new(None);

/// The two readings of the threads' CPU time of one arm (see [`THREAD_CPU`]).
#[derive(Default)]
pub(crate) struct ThreadTimes {
    start: Vec<ThreadTime>,
    end: Vec<ThreadTime>,
}

/// One thread of this process: its id, name, and CPU time in nanoseconds.
struct ThreadTime {
    id: u64,
    name: String,
    ns: u64,
}

/// Every live thread of this process (its CPU time is the first field of its schedstat).
fn threads_cpu() -> Vec<ThreadTime> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let id = dir.file_name()?.to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            let ns = std::fs::read_to_string(dir.join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some(ThreadTime {
                id,
                name: name.trim().to_owned(),
                ns,
            })
        })
        .collect()
}

/// With `--thread-cpu`, `f` applied to the running arm's readings; `None` without the flag.
fn with_thread_times<R>(f: impl FnOnce(&mut ThreadTimes) -> R) -> Option<R> {
    THREAD_CPU
        .lock()
        .ok()
        .as_deref_mut()
        .and_then(Option::as_mut)
        .map(f)
}

/// With `--thread-cpu`, reads every thread's CPU time into the running arm's `start` or `end`.
fn read_threads_cpu(into: fn(&mut ThreadTimes) -> &mut Vec<ThreadTime>) {
    with_thread_times(|times| *into(times) = threads_cpu());
}

/// This process's CPU time since `cpu0`, read when an arm's clock stops; with
/// `--thread-cpu`, every thread's is read at the same moment.
fn cpu_since(cpu0: Duration) -> Duration {
    let cpu = cpu_time() - cpu0;
    read_threads_cpu(|t| &mut t.end);
    cpu
}

/// `--thread-cpu`: prints the running arm's CPU time per message (of `n`) by thread name,
/// from its clock's start to the reading of its CPU time; threads that ended meanwhile are
/// not seen (the arm's `CPU µs` holds them).
fn print_threads_cpu(n: usize) {
    let Some(times) = with_thread_times(std::mem::take) else {
        return;
    };
    let mut by_name: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in times.end {
        let was = times
            .start
            .iter()
            .find(|s| s.id == t.id)
            .map_or(0, |s| s.ns);
        let e = by_name.entry(t.name).or_default();
        e.0 += 1;
        e.1 += t.ns.saturating_sub(was);
    }
    let line: Vec<String> = by_name
        .iter()
        .filter(|(_, (_, ns))| *ns > 0)
        .map(|(name, (k, ns))| format!("{name} x{k} {:.2}", *ns as f64 / 1e3 / n as f64))
        .collect();
    eprintln!("threads, CPU µs a message: {}", line.join(", "));
}

/// Resident set size of this process (VmRSS) in KiB, to show memory stays bounded.
pub(crate) fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or_default()
}

/// What an arm's figures other than its clocks are measured from, read when it starts and
/// again when it stops: this process's RSS and the local servers' CPU time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Baseline {
    rss_kib: u64,
    servers: ServersCpu,
}

impl Baseline {
    /// Reads both now.
    fn now() -> Self {
        Baseline {
            rss_kib: rss_kib(),
            servers: ServersCpu::now(),
        }
    }
}

/// An arm's clock: its wall time and this process's CPU time from the moment it starts, and
/// the [`Baseline`] it started at. Every arm starts one just before its first message is
/// handled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    /// When the clock started.
    pub(crate) start: Instant,
    cpu0: Duration,
    /// What the arm's other figures are measured from.
    pub(crate) base: Baseline,
}

impl Clock {
    /// Does the bench's own bookkeeping (the [`Baseline`], whose servers' CPU time is read
    /// from every process's /proc entry, a few ms; `--thread-cpu`'s readings) and then starts
    /// the clocks, so that none of it is counted in the arm's figures.
    pub(crate) fn start() -> Self {
        let base = Baseline::now();
        read_threads_cpu(|t| &mut t.start);
        perf_control("enable");
        let cpu0 = cpu_time();
        Clock {
            start: Instant::now(),
            cpu0,
            base,
        }
    }

    /// The arm's figures (see [`figures`]), with both clocks stopped now.
    pub(crate) fn figures(&self, n: usize, latencies: &mut [u64]) -> Figures {
        self.stop().figures(n, latencies)
    }

    /// Stops both clocks, for an arm with more to check before its figures.
    pub(crate) fn stop(&self) -> Stopped {
        let wall = self.start.elapsed();
        Stopped {
            wall,
            cpu: self.cpu(),
            base: self.base,
        }
    }

    /// This process's CPU time since the clock started (see [`cpu_since`]).
    pub(crate) fn cpu(&self) -> Duration {
        cpu_since(self.cpu0)
    }
}

/// An arm's clocks, stopped (see [`Clock::stop`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopped {
    wall: Duration,
    cpu: Duration,
    base: Baseline,
}

impl Stopped {
    /// The arm's figures (see [`figures`]).
    pub(crate) fn figures(self, n: usize, latencies: &mut [u64]) -> Figures {
        figures(n, self.wall, self.cpu, latencies, self.base)
    }
}

/// This process's CPU time, every thread's (the process CPU-time clock, to the nanosecond;
/// /proc/self/stat's 10 ms ticks if that clock cannot be read).
fn cpu_time() -> Duration {
    if let Ok(t) = cpu_time::ProcessTime::try_now() {
        return t.as_duration();
    }
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            // Fields 14 and 15 (utime, stime) are the 12th and 13th after the comm field.
            Some(after.get(11)?.parse::<u64>().ok()? + after.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or_default();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// User + system CPU time of the local servers' processes, from /proc (zero where not
/// readable): PostgreSQL's (the benchmark's database is local), and the brokers' (RabbitMQ
/// runs in `beam.smp`; Kafka in `java`), every such process on this machine, so another broker node
/// running beside the bench is counted too.
#[derive(Debug, Clone, Copy)]
struct ServersCpu {
    postgres: Duration,
    brokers: Duration,
}

impl ServersCpu {
    /// Reads every process's `stat` once.
    fn now() -> Self {
        let (mut postgres, mut brokers) = (0u64, 0u64);
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                    continue;
                };
                let Some((head, tail)) = stat.rsplit_once(')') else {
                    continue;
                };
                let Some((_, comm)) = head.rsplit_once('(') else {
                    continue;
                };
                let sum = match comm {
                    "postgres" => &mut postgres,
                    "beam.smp" | "java" => &mut brokers,
                    _ => continue,
                };
                let f: Vec<&str> = tail.split_whitespace().collect();
                let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                *sum += get(11) + get(12);
            }
        }
        // USER_HZ is 100 on Linux.
        ServersCpu {
            postgres: Duration::from_millis(postgres * 10),
            brokers: Duration::from_millis(brokers * 10),
        }
    }
}

/// CPU time per message of `n` messages from `start` to `end`.
fn per_msg(start: Duration, end: Duration, n: usize) -> f64 {
    end.saturating_sub(start).as_secs_f64() * 1e6 / n as f64
}

/// The `--perf-ctl` FIFO, opened once at start.
pub(crate) static PERF_CTL: OnceLock<Mutex<std::fs::File>> = OnceLock::new();

/// Writes `command` to the `--perf-ctl` FIFO, if there is one.
fn perf_control(command: &str) {
    if let Some(ctl) = PERF_CTL.get() {
        if let Ok(mut f) = ctl.lock() {
            let _ = std::io::Write::write_all(&mut *f, format!("{command}\n").as_bytes());
        }
    }
}

/// An arm's figures, taken when its clock stops (which also stops a `--perf-ctl` profile).
pub(crate) fn figures(
    n: usize,
    wall: Duration,
    cpu: Duration,
    latencies: &mut [u64],
    base: Baseline,
) -> Figures {
    perf_control("disable");
    let now = Baseline::now();
    print_threads_cpu(n);
    latencies.sort_unstable();
    let pct = |p: f64| percentile_ms(latencies, p);
    Figures {
        rate: n as f64 / wall.as_secs_f64(),
        cpu_us_per_msg: cpu.as_secs_f64() * 1e6 / n as f64,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        rss_mib: now.rss_kib.saturating_sub(base.rss_kib) as f64 / 1024.0,
        server_us_per_msg: per_msg(base.servers.postgres, now.servers.postgres, n),
        broker_us_per_msg: per_msg(base.servers.brokers, now.servers.brokers, n),
        measured_latency: !latencies.is_empty(),
        relay: None,
    }
}

/// The `p` quantile (0 to 1) of `sorted` microseconds, in milliseconds; 0 for none.
pub(crate) fn percentile_ms(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}
