//! The quickstart (`cargo run -p quickstart`) as the README describes it: it exits 0, and its
//! tally shows every unique job's invoice and email exactly once, the poison job
//! dead-lettered, and both simulated crashes.
//!
//! The counts of deliveries and handler runs depend on when the crashes land among the
//! concurrent deliveries, so only the invariants are checked, not the README's sample
//! figures.
//!
//! The binary belongs to another package, so the test builds it with
//! `cargo build -p quickstart --message-format=json` and runs the executable cargo reports.

// Test code: it may unwrap and print.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Builds the quickstart and returns its executable.
fn quickstart() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut args = vec!["build", "-p", "quickstart", "--message-format=json"];
    // The same profile as these tests, so `cargo test --release` builds nothing extra.
    if !cfg!(debug_assertions) {
        args.push("--release");
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent");
    let out = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo build");
    assert!(out.status.success(), "cargo build -p quickstart failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "quickstart")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo reports the quickstart executable")
}

/// The tally's `label    number` lines.
fn tally(stdout: &str) -> HashMap<String, i64> {
    stdout
        .lines()
        .filter_map(|line| {
            let (label, n) = line.trim_end().rsplit_once(' ')?;
            Some((label.trim().to_owned(), n.parse().ok()?))
        })
        .collect()
}

#[test]
fn quickstart_effects_match_the_unique_jobs() {
    let out = Command::new(quickstart())
        .env("RUST_LOG", "error")
        .output()
        .expect("run the quickstart");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the quickstart failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let t = tally(&stdout);
    let get = |label: &str| -> i64 {
        *t.get(label)
            .unwrap_or_else(|| panic!("no `{label}` in the tally:\n{stdout}"))
    };
    let (unique, poison) = (get("unique jobs"), get("poison jobs"));
    assert_eq!((unique, poison), (20, 1), "the README's scenario");
    assert_eq!(
        get("published"),
        unique + 5 + poison,
        "20 jobs, 5 again, 1 poison"
    );
    assert_eq!(get("invoices created"), unique);
    assert_eq!(get("emails recorded"), unique);
    assert_eq!(get("dead-lettered"), poison);
    assert_eq!(get("worker crashes (simulated)"), 2);
    // Every publish is delivered at least once, and so is every retry copy.
    assert!(
        get("deliveries") >= get("published") + get("retries"),
        "{stdout}"
    );
    // Every unique job ran, and the job that crashed before its commit ran again. The
    // poison job ran out its 3 attempts, but a crash may have interrupted one after its
    // claim counted it and before its handler started: it ran at least once.
    let at_least = unique + 1 + 1;
    assert!(get("handler runs") >= at_least, "{stdout}");
    // The five republished jobs, and the job whose crash came after its commit, ran once:
    // their other deliveries are duplicates.
    assert!(get("duplicates skipped") >= 6, "{stdout}");
    assert!(
        stdout.contains("dead letter: key=invoice-999 reason=max_attempts_exceeded attempts=3"),
        "{stdout}"
    );
    assert!(
        stdout.contains("OK: every job's effects happened exactly once."),
        "{stdout}"
    );
}
