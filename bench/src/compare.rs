//! `--compare BEFORE`: a before/after pair in one command. This binary (after) and another
//! build of the bench (before, e.g. built from the commit before a change) run alternately,
//! one repetition each per round, with the same arguments; the order flips every round so a
//! drift of the machine weighs on both alike. Each run writes its figures as JSON
//! (`--json`), and the pair is printed side by side: every arm's rate and client CPU, and
//! every ratio, as median [min, max] over the rounds.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

use crate::report::{Run, Spread, RATIOS};

/// The options a side's run must not inherit from the driver's command line: the driver's
/// own, and the ones it sets for each run.
const DRIVER_OPTIONS: [&str; 3] = ["--compare", "--reps", "--json"];

/// The driver's arguments without [`DRIVER_OPTIONS`] (as `--name value` or `--name=value`).
fn passed_on(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = arg.to_string_lossy();
        if DRIVER_OPTIONS.contains(&text.as_ref()) {
            skip_value = true;
        } else if !DRIVER_OPTIONS
            .iter()
            .any(|o| text.starts_with(&format!("{o}=")))
        {
            out.push(arg);
        }
    }
    out
}

/// Runs `binary` for one repetition with `args`, and reads back what it measured.
fn one_run(binary: &Path, args: &[OsString], json: &Path) -> anyhow::Result<Run> {
    let status = Command::new(binary)
        .args(args)
        .args(["--reps", "1", "--json"])
        .arg(json)
        .stdout(Stdio::null())
        .status()
        .with_context(|| format!("starting {}", binary.display()))?;
    if !status.success() {
        bail!("{} exited with {status}", binary.display());
    }
    let text = std::fs::read_to_string(json)
        .with_context(|| format!("reading the figures of {}", binary.display()))?;
    let _ = std::fs::remove_file(json);
    serde_json::from_str(&text).with_context(|| {
        format!(
            "the figures of {} (a build without --json cannot be compared)",
            binary.display()
        )
    })
}

/// Runs the pair for `rounds` rounds and prints it.
pub(crate) fn run(before: &Path, rounds: usize) -> anyhow::Result<()> {
    let after: PathBuf = std::env::current_exe().context("this binary's path")?;
    let args = passed_on(std::env::args_os().skip(1));
    let json = std::env::temp_dir().join(format!("bench-compare-{}.json", std::process::id()));
    let (mut a, mut b) = (Run::default(), Run::default());
    for round in 0..rounds {
        let sides = if round % 2 == 0 {
            [(before, &mut a), (after.as_path(), &mut b)]
        } else {
            [(after.as_path(), &mut b), (before, &mut a)]
        };
        for (binary, run) in sides {
            eprintln!("round {round}: {}", binary.display());
            run.extend(one_run(binary, &args, &json)?);
        }
    }
    println!(
        "\n{rounds} rounds, one repetition of each build per round, alternating; median [min, max]\nbefore: {}\nafter:  {}\n",
        before.display(),
        after.display()
    );
    println!("{:<44} {:>24} {:>24}", "arm: msgs/s", "before", "after");
    let pair = |x: Option<Spread>, p: usize| x.map_or("-".to_owned(), |s| format!("{s:.p$}"));
    for arm in &b.arms {
        println!(
            "{arm:<44} {:>24} {:>24}",
            pair(a.spread(arm, |f| f.rate), 0),
            pair(b.spread(arm, |f| f.rate), 0)
        );
    }
    println!(
        "\n{:<44} {:>24} {:>24}",
        "arm: client CPU µs a message", "before", "after"
    );
    for arm in &b.arms {
        println!(
            "{arm:<44} {:>24} {:>24}",
            pair(a.spread(arm, |f| f.cpu_us_per_msg), 1),
            pair(b.spread(arm, |f| f.cpu_us_per_msg), 1)
        );
    }
    println!("\n{:<44} {:>24} {:>24}", "ratio", "before", "after");
    for r in RATIOS {
        let (x, y) = (a.ratio(r), b.ratio(r));
        if x.is_some() || y.is_some() {
            println!("{:<44} {:>24} {:>24}", r.label, pair(x, 2), pair(y, 2));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_driver_options_are_not_passed_on() {
        let args = strings(&[
            "--messages",
            "3000",
            "--compare",
            "/tmp/old",
            "--reps=7",
            "--arms",
            "memory: fw",
            "--json",
            "x.json",
            "--reps",
            "2",
        ]);
        assert_eq!(
            passed_on(args),
            strings(&["--messages", "3000", "--arms", "memory: fw"])
        );
    }
}
