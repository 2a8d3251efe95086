//! A before/after pair in one command. `--compare BEFORE`: this binary (after) and another
//! build of the bench (before, e.g. built from the commit before a change); `--compare-metrics`:
//! this binary with `--metrics off` (before) and `--metrics on` (after). The two sides run
//! alternately, one repetition each per round, with the same arguments otherwise; the order
//! flips every round so a drift of the machine weighs on both alike. Each run writes its figures as JSON
//! (`--json`), and the pair is printed side by side: every arm's rate and client CPU, and
//! every ratio, as median [min, max] over the rounds.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

use crate::report::{Run, Spread, RATIOS};

/// The options with a value that a side's run must not inherit from the driver's command
/// line: the driver's own and the ones it sets for each run. The options a side sets itself
/// (`--metrics` under `--compare-metrics`) are left out too, and only those: under
/// `--compare BEFORE`, a `--metrics on` of the command line goes to both builds.
const DRIVER_OPTIONS: [&str; 3] = ["--compare", "--reps", "--json"];

/// The driver's flags (no value) that a side's run must not inherit.
const DRIVER_FLAGS: [&str; 1] = ["--compare-metrics"];

/// The driver's arguments without [`DRIVER_OPTIONS`] and the options in `set_by_sides` (as
/// `--name value` or `--name=value`), and without [`DRIVER_FLAGS`].
fn passed_on(args: impl IntoIterator<Item = OsString>, set_by_sides: &[String]) -> Vec<OsString> {
    let options: Vec<&str> = DRIVER_OPTIONS
        .iter()
        .copied()
        .chain(set_by_sides.iter().map(String::as_str))
        .collect();
    let mut out = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = arg.to_string_lossy();
        if options.contains(&text.as_ref()) {
            skip_value = true;
        } else if !DRIVER_FLAGS.contains(&text.as_ref())
            && !options.iter().any(|o| text.starts_with(&format!("{o}=")))
        {
            out.push(arg);
        }
    }
    out
}

/// One side of a pair: a bench binary and the arguments only this side gets.
pub(crate) struct Side {
    /// The binary.
    pub(crate) binary: PathBuf,
    /// Appended to the arguments both sides get.
    pub(crate) extra: Vec<OsString>,
}

impl Side {
    /// Another build of the bench, with the same arguments as this one.
    pub(crate) fn build(binary: &Path) -> Side {
        Side {
            binary: binary.to_owned(),
            extra: Vec::new(),
        }
    }

    /// This binary, with `extra` arguments.
    pub(crate) fn this(extra: &[&str]) -> anyhow::Result<Side> {
        Ok(Side {
            binary: std::env::current_exe().context("this binary's path")?,
            extra: extra.iter().map(OsString::from).collect(),
        })
    }

    /// The options (`--name`) this side sets itself.
    fn options(&self) -> impl Iterator<Item = String> + '_ {
        self.extra
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .filter(|a| a.starts_with("--"))
            .map(|a| a.split('=').next().unwrap_or_default().to_owned())
    }

    fn describe(&self) -> String {
        let extra: Vec<_> = self.extra.iter().map(|a| a.to_string_lossy()).collect();
        if extra.is_empty() {
            self.binary.display().to_string()
        } else {
            format!("{} {}", self.binary.display(), extra.join(" "))
        }
    }
}

/// Runs `binary` for one repetition with `args`, and reads back what it measured.
fn one_run(side: &Side, args: &[OsString], json: &Path) -> anyhow::Result<Run> {
    let binary = &side.binary;
    let status = Command::new(binary)
        .args(args)
        .args(&side.extra)
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
pub(crate) fn run(before: &Side, after: &Side, rounds: usize) -> anyhow::Result<()> {
    let set_by_sides: Vec<String> = before.options().chain(after.options()).collect();
    let args = passed_on(std::env::args_os().skip(1), &set_by_sides);
    let json = std::env::temp_dir().join(format!("bench-compare-{}.json", std::process::id()));
    let (mut a, mut b) = (Run::default(), Run::default());
    for round in 0..rounds {
        let sides = if round % 2 == 0 {
            [(before, &mut a), (after, &mut b)]
        } else {
            [(after, &mut b), (before, &mut a)]
        };
        for (side, run) in sides {
            eprintln!("round {round}: {}", side.describe());
            run.extend(one_run(side, &args, &json)?);
        }
    }
    println!(
        "\n{rounds} rounds, one repetition of each build per round, alternating; median [min, max]\nbefore: {}\nafter:  {}\n",
        before.describe(),
        after.describe()
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
            "--compare-metrics",
            "--metrics=on",
        ]);
        // Under --compare-metrics each side sets --metrics: the command line's is left out.
        let sides = vec!["--metrics".to_owned()];
        assert_eq!(
            passed_on(args.clone(), &sides),
            strings(&["--messages", "3000", "--arms", "memory: fw"])
        );
        // Under --compare neither side sets it: both builds get the command line's.
        assert_eq!(
            passed_on(args, &[]),
            strings(&["--messages", "3000", "--arms", "memory: fw", "--metrics=on"])
        );
    }

    #[test]
    fn a_side_names_the_options_it_sets() {
        let side = Side::this(&["--metrics", "on", "--relay-batch=5"]).unwrap();
        let options: Vec<String> = side.options().collect();
        assert_eq!(options, ["--metrics", "--relay-batch"]);
    }
}
