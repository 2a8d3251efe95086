//! The worker processes: started from the example's binaries, killed, stopped, restarted,
//! and counted by how they ended.

use std::fs::OpenOptions;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::process::{Child, Command};

use crate::rng::Rng;

/// Which example binary a worker process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Role {
    /// `invoice_worker`: `send_invoice` and the outbox's relay.
    Invoice,
    /// `email_worker`: `send_email`.
    Email,
    /// `invoices`: both handlers and the relay in one process (an `App`).
    All,
}

impl Role {
    /// Every role, in the order the fleet starts them.
    pub(crate) const ALL: [Role; 3] = [Role::Invoice, Role::Email, Role::All];

    pub(crate) fn binary(self) -> &'static str {
        match self {
            Role::Invoice => "invoice_worker",
            Role::Email => "email_worker",
            Role::All => "invoices",
        }
    }
}

struct Slot {
    role: Role,
    child: Option<Child>,
    pid: u32,
    incarnation: u64,
    stopped: bool,
    /// Killed by us: its SIGKILL is a kill, not a mystery.
    killed: bool,
    /// Being removed for good (SIGTERM): not restarted.
    leaving: bool,
    /// When this incarnation was started.
    started: Instant,
    /// Sent SIGTERM within [`STARTING`] of its start: it may die of it (see there).
    termed_starting: bool,
}

/// How long a worker may take to take SIGTERM over from the default action (its first
/// step, after the process, the runtime and the logging start): a worker sent SIGTERM this
/// soon after its start (just restarted after a kill, when the runner removes it or ends
/// the run) may die of it, which loses nothing and is not a worker's fault. Dying of a
/// later SIGTERM is an unexpected exit: the worker did not stop gracefully.
const STARTING: Duration = Duration::from_secs(5);

impl Slot {
    /// Sends SIGTERM, noting whether it comes within [`STARTING`] of the start.
    fn terminate(&mut self) {
        self.termed_starting = self.started.elapsed() < STARTING;
        signal(self.pid, "TERM");
    }
}

/// How the worker processes ended, and what was done to them.
#[derive(Debug, Default, Clone)]
pub(crate) struct Counts {
    pub(crate) starts: u64,
    pub(crate) kills: u64,
    pub(crate) stops: u64,
    /// Exits by SIGABRT: a fault point fired.
    pub(crate) aborts: u64,
    /// Members added (Kafka) and removed gracefully.
    pub(crate) joined: u64,
    pub(crate) left: u64,
    /// Deaths by a SIGTERM sent within [`STARTING`] of the worker's start.
    pub(crate) termed_starting: u64,
    /// Exits nobody asked for (not SIGABRT, not our SIGKILL): with their log file.
    pub(crate) unexpected_exits: Vec<String>,
}

/// The worker processes of one run.
pub(crate) struct Fleet {
    bin_dir: PathBuf,
    log_dir: PathBuf,
    env: Vec<(String, String)>,
    fault_spec: Option<String>,
    seed: u64,
    slots: Vec<Slot>,
    /// When set, each slot's worker is a static Kafka group member named after it
    /// (`KAFKA_INSTANCE_ID=<prefix>-w<slot>`), the same name in every incarnation.
    member_prefix: Option<String>,
    pub(crate) counts: Counts,
}

impl Fleet {
    pub(crate) fn new(
        bin_dir: &Path,
        log_dir: &Path,
        env: Vec<(String, String)>,
        fault_spec: Option<String>,
        seed: u64,
    ) -> Self {
        Fleet {
            bin_dir: bin_dir.to_owned(),
            log_dir: log_dir.to_owned(),
            env,
            fault_spec,
            seed,
            slots: Vec::new(),
            member_prefix: None,
            counts: Counts::default(),
        }
    }

    /// Names each slot's worker as a static group member (see `member_prefix`).
    pub(crate) fn name_members(&mut self, prefix: &str) {
        self.member_prefix = Some(prefix.to_owned());
    }

    /// Starts one more worker of `role`; returns its slot.
    pub(crate) fn add(&mut self, role: Role) -> anyhow::Result<usize> {
        self.slots.push(Slot {
            role,
            child: None,
            pid: 0,
            incarnation: 0,
            stopped: false,
            killed: false,
            leaving: false,
            started: Instant::now(),
            termed_starting: false,
        });
        let i = self.slots.len() - 1;
        self.spawn(i)?;
        Ok(i)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let slot = &mut self.slots[i];
        slot.incarnation += 1;
        let log = self.log_dir.join(format!("worker-{i}.log"));
        let stderr = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("open {}", log.display()))?;
        let mut cmd = Command::new(self.bin_dir.join(slot.role.binary()));
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(prefix) = &self.member_prefix {
            cmd.env("KAFKA_INSTANCE_ID", format!("{prefix}-w{i}"));
        }
        if let Some(spec) = &self.fault_spec {
            // A different, reproducible fault sequence per worker and incarnation.
            let seed = self
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add((i as u64) << 32)
                .wrapping_add(slot.incarnation);
            cmd.env("CONSUMER_FAULTS", spec)
                .env("CONSUMER_FAULT_SEED", seed.to_string());
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("start {}", slot.role.binary()))?;
        slot.pid = child.id().unwrap_or(0);
        slot.child = Some(child);
        slot.stopped = false;
        slot.killed = false;
        slot.started = Instant::now();
        slot.termed_starting = false;
        self.counts.starts += 1;
        Ok(())
    }

    /// Notes every worker that exited and restarts it, unless it was leaving.
    pub(crate) fn reap(&mut self) -> anyhow::Result<()> {
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            let Some(status) = child.try_wait()? else {
                continue;
            };
            slot.child = None;
            match status.signal() {
                Some(6) => self.counts.aborts += 1,
                Some(9) if slot.killed => {}
                Some(15) if slot.leaving && slot.termed_starting => {
                    self.counts.termed_starting += 1;
                }
                _ if slot.leaving && status.success() => {}
                _ => self.counts.unexpected_exits.push(format!(
                    "{} (slot {i}, pid {}): {status}; log {}",
                    slot.role.binary(),
                    slot.pid,
                    self.log_dir.join(format!("worker-{i}.log")).display()
                )),
            }
            if !slot.leaving {
                self.spawn(i)?;
            }
        }
        Ok(())
    }

    fn running(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| {
                let s = &self.slots[i];
                s.child.is_some() && !s.stopped && !s.leaving
            })
            .collect()
    }

    /// SIGKILLs a random running worker (it is restarted by the next [`Fleet::reap`]).
    pub(crate) fn kill_random(&mut self, rng: &mut Rng) {
        let running = self.running();
        if running.is_empty() {
            return;
        }
        let i = running[usize::try_from(rng.below(running.len() as u64)).unwrap_or(0)];
        let slot = &mut self.slots[i];
        if let Some(child) = slot.child.as_mut() {
            if child.start_kill().is_ok() {
                slot.killed = true;
                self.counts.kills += 1;
            }
        }
    }

    /// SIGSTOPs a random running worker; returns its slot, for [`Fleet::resume`].
    pub(crate) fn stop_random(&mut self, rng: &mut Rng) -> Option<usize> {
        let running = self.running();
        if running.is_empty() {
            return None;
        }
        let i = running[usize::try_from(rng.below(running.len() as u64)).unwrap_or(0)];
        signal(self.slots[i].pid, "STOP");
        self.slots[i].stopped = true;
        self.counts.stops += 1;
        Some(i)
    }

    /// SIGCONTs a worker stopped by [`Fleet::stop_random`].
    pub(crate) fn resume(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.stopped {
            if slot.child.is_some() {
                signal(slot.pid, "CONT");
            }
            slot.stopped = false;
        }
    }

    /// Removes a random added member for good, gracefully (SIGTERM) or, when `abrupt`, with
    /// SIGKILL (it leaves by session timeout); `false` if none is left.
    pub(crate) fn remove_extra(&mut self, first_extra: usize, rng: &mut Rng, abrupt: bool) -> bool {
        let extra: Vec<usize> = self
            .running()
            .into_iter()
            .filter(|&i| i >= first_extra)
            .collect();
        if extra.is_empty() {
            return false;
        }
        let i = extra[usize::try_from(rng.below(extra.len() as u64)).unwrap_or(0)];
        self.slots[i].leaving = true;
        if abrupt {
            self.slots[i].killed = true;
            signal(self.slots[i].pid, "KILL");
        } else {
            self.slots[i].terminate();
        }
        self.counts.left += 1;
        true
    }

    /// Every worker, gracefully: SIGCONT the stopped, SIGTERM all, wait up to `grace`,
    /// then SIGKILL what is left.
    pub(crate) async fn shutdown(&mut self, grace: Duration) -> anyhow::Result<()> {
        for slot in &mut self.slots {
            if slot.child.is_none() {
                continue;
            }
            if slot.stopped {
                signal(slot.pid, "CONT");
                slot.stopped = false;
            }
            slot.leaving = true;
            slot.terminate();
        }
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            self.reap()?;
            if self.slots.iter().all(|s| s.child.is_none()) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                for slot in &mut self.slots {
                    if let Some(child) = slot.child.as_mut() {
                        self.counts.unexpected_exits.push(format!(
                            "{} (pid {}) ignored SIGTERM for {grace:?}",
                            slot.role.binary(),
                            slot.pid
                        ));
                        let _ = child.start_kill();
                        slot.killed = true;
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                self.reap()?;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `kill -SIG pid` (no libc binding needed for a handful of signals).
fn signal(pid: u32, sig: &str) {
    if pid == 0 {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
