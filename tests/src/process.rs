//! The examples' binaries as real processes: built once per test process, started with a
//! test's environment, signalled, and waited for with a deadline.
//!
//! The binaries belong to another package (`invoices`), so `CARGO_BIN_EXE_*` does not exist
//! here and `cargo test` does not build them. [`example_binary`] builds one with
//! `cargo build -p invoices --bin NAME --message-format=json` and takes the executable's
//! path from cargo's own report, which stays right under `CARGO_TARGET_DIR` or a configured
//! target directory (no guessed `target/debug` path).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::amqp::repo_root;

/// Builds the `invoices` binary `name` once per test process and returns its path.
pub fn example_binary(name: &str) -> PathBuf {
    package_binary("invoices", name)
}

/// Builds the binary `name` of the workspace package `package` once per test process and
/// returns its path.
pub fn package_binary(package: &str, name: &str) -> PathBuf {
    static PATHS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let paths = PATHS.get_or_init(Mutex::default);
    // Held while building: two tests asking at once build once.
    let mut paths = paths.lock().unwrap_or_else(|e| e.into_inner());
    let id = format!("{package}/{name}");
    if let Some(path) = paths.get(&id) {
        return path.clone();
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut args = vec![
        "build",
        "-p",
        package,
        "--bin",
        name,
        "--message-format=json",
    ];
    // The same profile as these tests, so `cargo test --release` builds nothing extra.
    if !cfg!(debug_assertions) {
        args.push("--release");
    }
    let out = Command::new(cargo)
        .args(args)
        .current_dir(repo_root())
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo build");
    assert!(
        out.status.success(),
        "cargo build -p {package} --bin {name} failed"
    );
    let path = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reports the {name} executable"));
    paths.insert(id, path.clone());
    path
}

/// A worker process and the file its log goes to. Dropping it kills the process.
pub struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Starts the `invoices` binary `name` with `vars`, its log (stderr) in `log`.
    pub fn spawn(name: &str, vars: &HashMap<&'static str, String>, log: PathBuf) -> Process {
        Process::spawn_binary(example_binary(name), vars, log)
    }

    /// Starts the executable at `path` with `vars`, its log (stderr) in `log`.
    pub fn spawn_binary(
        path: PathBuf,
        vars: &HashMap<&'static str, String>,
        log: PathBuf,
    ) -> Process {
        let name = path.display().to_string();
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(&path)
            .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Process { child, log }
    }

    /// The log so far, without colour codes.
    pub fn log(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM");
    }

    /// Waits up to 60 s for the process to exit; its status and log.
    pub async fn exit(mut self) -> (ExitStatus, String) {
        let start = tokio::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the worker") {
                return (status, self.log());
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = self.child.kill();
                panic!("the worker did not exit within 60s:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // A failed assertion must not leave a worker behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `s` without ANSI escape sequences.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
