//! Running the `consumer` binary from the tests.

#![allow(dead_code)]

use std::process::Output;

use serde_json::Value;

/// Runs `consumer ARGS` as a process with the servers' environment plus `env`, and shows
/// what it printed in the test's output.
pub(crate) async fn consumer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_consumer"));
    command.args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the command's task")
        .expect("run consumer");
    eprintln!(
        "$ consumer {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `consumer ARGS --json`, which must succeed: its JSON result.
pub(crate) async fn json_of(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = consumer(&args, env).await;
    assert!(out.status.success(), "consumer {args:?} failed");
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}
