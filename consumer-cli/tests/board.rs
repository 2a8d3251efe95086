//! `consumer board` against real RabbitMQ and PostgreSQL, in a real browser: a worker
//! dead-letters five messages for two reasons; a read-only board shows them grouped and
//! refuses every action; with `--allow-actions`, Debian's Chromium, driven by Playwright
//! (`tests/board/board.mjs`), sees the groups, opens a letter whole, and replays the group
//! of three after its confirmation page; once the cause is fixed those three complete once
//! and the other two stay in the DLQ. A form without the board's token is refused.
//!
//! Needs `node`, `/usr/bin/chromium` (or `CHROMIUM`) and `npm ci --prefix
//! consumer-cli/tests/board` (scripts/test.sh does both). `BOARD_SCREENSHOT=PATH` keeps the
//! browser's picture of the overview (the README's).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use consumer_tests::amqp::{self, wait_for, Rabbit};
use consumer_tests::common::{database_url, DEADLINE};
use support::{wait_completed, FiveDeadLetters, FIXED, HANDLER};

mod support;

const WAIT: Duration = Duration::from_secs(60);

/// A `consumer board` process, killed when dropped.
struct Board {
    child: Child,
    base: String,
}

impl Board {
    /// Starts `consumer board --listen 127.0.0.1:0 ARGS` with the servers' environment plus
    /// `env`, and waits, up to [`DEADLINE`], for the address it serves; panics saying so if
    /// the board exits or stays silent until then.
    fn start(args: &[&str], env: &[(&str, &str)]) -> Board {
        let mut command = Command::new(env!("CARGO_BIN_EXE_consumer"));
        command
            .args(["board", "--listen", "127.0.0.1:0"])
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("start consumer board");
        let stderr = child.stderr.take().expect("its stderr");
        // Killed when dropped, so also if the wait below panics.
        let mut board = Board {
            child,
            base: String::new(),
        };
        // Its stderr is read on a thread of its own, to the end (the replays' progress), so
        // that the board never blocks on a full pipe and the wait below has a deadline: a
        // blocking read would hang the test with a board that hangs.
        let (lines_tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("board: {line}");
                // Nobody listens once the address is known.
                let _ = lines_tx.send(line);
            }
        });
        let deadline = Instant::now() + DEADLINE;
        board.base = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("consumer board did not print where it serves within {DEADLINE:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("consumer board ended without printing where it serves (see above)")
                }
            };
            if let Some(rest) = line.strip_prefix("board: serving ") {
                break rest
                    .split_whitespace()
                    .next()
                    .expect("a URL")
                    .trim_end_matches('/')
                    .to_owned();
            }
        };
        board
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the browser script against `url`; panics with its output if it fails.
fn browse(url: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/board");
    assert!(
        dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed: run `npm ci --prefix consumer-cli/tests/board`"
    );
    let mut command = Command::new("node");
    command.current_dir(&dir).arg("board.mjs").arg(url);
    if let Ok(path) = std::env::var("BOARD_SCREENSHOT") {
        command.arg(path);
    }
    let out = command.output().expect("run node (is Node.js installed?)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "the browser test failed: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_board_groups_dead_letters_and_replays_a_group_in_a_browser() {
    let FiveDeadLetters {
        pg,
        cfg,
        dlq,
        inbox,
        running,
        publisher,
        rejected,
        flaky: _,
    } = FiveDeadLetters::new("board").await;
    let env = [
        ("DB_SCHEMA", pg.schema.as_str()),
        ("DLQ_QUEUE", dlq.as_str()),
        ("AMQP_ORIGIN_SECRET", amqp::ORIGIN_SECRET),
    ];
    let client = reqwest::Client::new();

    // Read-only: the groups, no action, and a form is refused.
    {
        let board = Board::start(&["--broker", "amqp"], &env);
        let page = client
            .get(format!("{}/", board.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(page.contains("permanent_error"), "{page}");
        assert!(page.contains("order # rejected by the provider"), "{page}");
        assert!(!page.contains("Replay group"), "{page}");
        // The inbox's dead-letter table too, in a section of its own.
        assert!(
            page.contains("0 dead letters in the inbox&#39;s dead-letter table"),
            "{page}"
        );
        // No URL with its credentials (the test database's password is a common word, so
        // the check is for it as a URL holds it).
        let userinfo = database_url()
            .split_once("://")
            .and_then(|(_, rest)| rest.split_once('@'))
            .map(|(userinfo, _)| format!("{userinfo}@"));
        for secret in [Some(database_url()), userinfo].into_iter().flatten() {
            assert!(!page.contains(&secret), "a credential on the page");
        }
        let refused = client
            .post(format!("{}/act", board.base))
            .form(&[
                ("action", "replay"),
                ("reason", "permanent_error"),
                ("token", "x"),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 403);
    }
    wait_for("the DLQ still holds 5", WAIT, || async {
        Rabbit::ready(&dlq).await == 5
    })
    .await;

    let board = Board::start(&["--broker", "amqp", "--allow-actions"], &env);
    // A form posted from elsewhere (without this board's token) is refused.
    let forged = client
        .post(format!("{}/act", board.base))
        .form(&[
            ("action", "discard"),
            ("reason", "permanent_error"),
            ("fingerprint", "order # rejected by the provider"),
            ("token", "not-the-boards"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);

    FIXED.store(true, Ordering::SeqCst);
    let url = format!("{}/", board.base);
    tokio::task::spawn_blocking(move || browse(&url))
        .await
        .expect("the browser's task");

    wait_completed(&inbox, HANDLER, &rejected, WAIT).await;
    for id in &rejected {
        let sql = format!(
            "SELECT count(*) FROM \"{}\".ledger WHERE job_id = $1",
            pg.schema
        );
        let runs: i64 = sqlx::query_scalar(&sql)
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .unwrap();
        assert_eq!(runs, 1, "{id} ran once");
    }
    wait_for("the DLQ keeps the other 2", WAIT, || async {
        Rabbit::ready(&dlq).await == 2
    })
    .await;
    let page = client
        .get(format!("{}/", board.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("2 dead letters"), "{page}");
    assert!(!page.contains("permanent_error"), "{page}");
    drop(board);
    publisher.close().await;
    running.stop().await;
    Rabbit::delete_topology(&cfg).await;
}
