//! The report of a run: every arm's figures and the ratios between arms, each the median
//! over the repetitions with its spread (the smallest and the largest repetition), and the
//! same figures as JSON (`--json`), which `--compare` reads back.
//!
//! A ratio is taken within each repetition (its two arms ran one after the other, on the
//! same machine state) and then summarised, so its spread is the spread of the comparison,
//! not of either arm alone.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::measure::{Figures, RelayFigures};

/// What one invocation measured: the arms in the order they ran, and each arm's figures,
/// one entry per repetition.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Run {
    pub(crate) arms: Vec<String>,
    pub(crate) figures: BTreeMap<String, Vec<Figures>>,
}

/// A figure's median over the repetitions, and its smallest and largest value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Spread {
    /// `None` for no values. The median of an even count is the upper middle value.
    pub(crate) fn of(mut values: Vec<f64>) -> Option<Spread> {
        values.sort_by(f64::total_cmp);
        Some(Spread {
            median: *values.get(values.len() / 2)?,
            min: *values.first()?,
            max: *values.last()?,
        })
    }
}

impl fmt::Display for Spread {
    /// `0.91 [0.85, 0.97]`; the precision (`{:.0}`) applies to all three.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = f.precision().unwrap_or(2);
        write!(
            f,
            "{:.p$} [{:.p$}, {:.p$}]",
            self.median, self.min, self.max
        )
    }
}

/// What a ratio compares.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Measure {
    /// Messages a second: above 1, `over` is faster.
    Rate,
    /// This process's CPU time a message: above 1, `over` costs more.
    Cpu,
    /// Messages consumed a second: an `+ outbox` arm's rate up to its last ack, before its
    /// relay has published the last event (any other arm's rate).
    Consumed,
}

/// A ratio of the report: `over`'s figure over the smallest of `under`'s.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ratio {
    pub(crate) label: &'static str,
    pub(crate) measure: Measure,
    pub(crate) over: &'static str,
    pub(crate) under: &'static [&'static str],
}

/// The ratios the report prints, in order. Each names its arms exactly; a ratio whose arms
/// did not run is left out.
pub(crate) const RATIOS: &[Ratio] = &[
    Ratio::rate(
        "memory: fw 1/tx / memory: hand 1/tx",
        "memory: fw 1/tx",
        &["memory: hand 1/tx"],
    ),
    Ratio::rate(
        "memory: fw 1/tx / db floor 1/tx",
        "memory: fw 1/tx",
        &["db floor, 1/tx"],
    ),
    Ratio::rate(
        "memory: fw batched / db floor N/tx",
        "memory: fw batched",
        &["db floor, N/tx"],
    ),
    Ratio::rate(
        "memory: fw batched 1 stmt/msg / that floor",
        "memory: fw batched, 1 stmt/msg",
        &["db floor, N/tx, 1 stmt/msg"],
    ),
    Ratio::rate(
        "amqp: fw 1/tx / amqp: hand 1/tx",
        "amqp: fw 1/tx",
        &["amqp: hand 1/tx"],
    ),
    Ratio::rate(
        "amqp: fw batched / amqp: raw consume+ack",
        "amqp: fw batched",
        &["amqp: raw consume+ack"],
    ),
    Ratio::rate(
        "amqp: fw batched / amqp: hand batched",
        "amqp: fw batched",
        &["amqp: hand batched"],
    ),
    Ratio::rate(
        "amqp: hand batched / amqp: raw consume+ack",
        "amqp: hand batched",
        &["amqp: raw consume+ack"],
    ),
    Ratio::rate(
        "amqp: raw ack each / amqp: raw consume+ack",
        "amqp: raw ack each",
        &["amqp: raw consume+ack"],
    ),
    Ratio::rate(
        "amqp: fw batched / db floor N/tx",
        "amqp: fw batched",
        &["db floor, N/tx"],
    ),
    Ratio::rate(
        "kafka: fw 1/tx / kafka: hand 1/tx",
        "kafka: fw 1/tx",
        &["kafka: hand 1/tx"],
    ),
    Ratio::rate(
        "kafka: fw 1/tx / db floor 1/tx",
        "kafka: fw 1/tx",
        &["db floor, 1/tx"],
    ),
    Ratio::rate(
        "kafka: fw batched / kafka: raw consume+store",
        "kafka: fw batched",
        &["kafka: raw consume+store"],
    ),
    Ratio::rate(
        "kafka: fw batched / kafka: hand batched",
        "kafka: fw batched",
        &["kafka: hand batched"],
    ),
    Ratio::rate(
        "kafka: hand batched / db floor N/tx",
        "kafka: hand batched",
        &["db floor, N/tx"],
    ),
    Ratio::rate(
        "kafka: fw batched / db floor N/tx",
        "kafka: fw batched",
        &["db floor, N/tx"],
    ),
    // The Kafka goal's reference: the slower of the raw client and the bulk floor.
    Ratio::rate(
        "kafka: fw batched / min(raw, floor N/tx)",
        "kafka: fw batched",
        &["kafka: raw consume+store", "db floor, N/tx"],
    ),
    // What bounds the outbox arms before any relay: the floor's rows and the event's row
    // in the handler's transaction, over the floor's rows alone.
    Ratio::rate(
        "db floor N/tx + event / db floor N/tx",
        "db floor, N/tx + event",
        &["db floor, N/tx"],
    ),
    Ratio::rate(
        "db floor 1/tx + event / db floor 1/tx",
        "db floor, 1/tx + event",
        &["db floor, 1/tx"],
    ),
    // The relay's own cost over publishing the same events with the raw producer.
    Ratio::rate(
        "kafka: relay alone / kafka: raw produce",
        "kafka: relay alone",
        &["kafka: raw produce"],
    ),
    // What the outbox costs: each message also writes an event that a relay publishes, and
    // the arm ends at the last event confirmed.
    Ratio::rate(
        "amqp: fw 1/tx + outbox / fw 1/tx",
        "amqp: fw 1/tx + outbox",
        &["amqp: fw 1/tx"],
    ),
    Ratio::rate(
        "amqp: fw batched + outbox / fw batched",
        "amqp: fw batched + outbox",
        &["amqp: fw batched"],
    ),
    Ratio::rate(
        "kafka: fw 1/tx + outbox / fw 1/tx",
        "kafka: fw 1/tx + outbox",
        &["kafka: fw 1/tx"],
    ),
    Ratio::rate(
        "kafka: fw batched + outbox / fw batched",
        "kafka: fw batched + outbox",
        &["kafka: fw batched"],
    ),
    // Near 1, the relay's own pace bounds the arm.
    Ratio::rate(
        "amqp: fw batched + outbox / relay alone",
        "amqp: fw batched + outbox",
        &["amqp: relay alone"],
    ),
    Ratio::rate(
        "kafka: fw batched + outbox / relay alone",
        "kafka: fw batched + outbox",
        &["kafka: relay alone"],
    ),
    // The same up to the last ack: the consumer's own pace beside its relay.
    Ratio::consumed(
        "acked: amqp fw batched + outbox / fw batched",
        "amqp: fw batched + outbox",
        &["amqp: fw batched"],
    ),
    Ratio::consumed(
        "acked: kafka fw batched + outbox / fw batched",
        "kafka: fw batched + outbox",
        &["kafka: fw batched"],
    ),
    // The framework's own cost: its client CPU a message over the hand-written consumer's.
    Ratio::cpu(
        "CPU: memory fw 1/tx / hand 1/tx",
        "memory: fw 1/tx",
        &["memory: hand 1/tx"],
    ),
    Ratio::cpu(
        "CPU: amqp fw 1/tx / hand 1/tx",
        "amqp: fw 1/tx",
        &["amqp: hand 1/tx"],
    ),
    Ratio::cpu(
        "CPU: amqp fw batched / hand batched",
        "amqp: fw batched",
        &["amqp: hand batched"],
    ),
    Ratio::cpu(
        "CPU: kafka fw 1/tx / hand 1/tx",
        "kafka: fw 1/tx",
        &["kafka: hand 1/tx"],
    ),
    Ratio::cpu(
        "CPU: kafka fw batched / hand batched",
        "kafka: fw batched",
        &["kafka: hand batched"],
    ),
    Ratio::cpu(
        "CPU: amqp fw batched + outbox / fw batched",
        "amqp: fw batched + outbox",
        &["amqp: fw batched"],
    ),
    Ratio::cpu(
        "CPU: kafka fw batched + outbox / fw batched",
        "kafka: fw batched + outbox",
        &["kafka: fw batched"],
    ),
];

impl Ratio {
    const fn of(
        measure: Measure,
        label: &'static str,
        over: &'static str,
        under: &'static [&'static str],
    ) -> Ratio {
        Ratio {
            label,
            measure,
            over,
            under,
        }
    }

    const fn rate(
        label: &'static str,
        over: &'static str,
        under: &'static [&'static str],
    ) -> Ratio {
        Ratio::of(Measure::Rate, label, over, under)
    }

    const fn cpu(label: &'static str, over: &'static str, under: &'static [&'static str]) -> Ratio {
        Ratio::of(Measure::Cpu, label, over, under)
    }

    const fn consumed(
        label: &'static str,
        over: &'static str,
        under: &'static [&'static str],
    ) -> Ratio {
        Ratio::of(Measure::Consumed, label, over, under)
    }
}

impl Run {
    /// Appends `other`'s repetitions to this run's (a `--compare` side's rounds).
    pub(crate) fn extend(&mut self, other: Run) {
        for arm in other.arms {
            if !self.arms.contains(&arm) {
                self.arms.push(arm);
            }
        }
        for (arm, figures) in other.figures {
            self.figures.entry(arm).or_default().extend(figures);
        }
    }

    /// One of an arm's figures over the repetitions.
    pub(crate) fn spread(&self, arm: &str, figure: fn(&Figures) -> f64) -> Option<Spread> {
        Spread::of(self.figures.get(arm)?.iter().map(figure).collect())
    }

    /// The ratio within each repetition, summarised; `None` if one of its arms did not run.
    pub(crate) fn ratio(&self, r: &Ratio) -> Option<Spread> {
        let figure = |f: &Figures| match r.measure {
            Measure::Rate => f.rate,
            Measure::Cpu => f.cpu_us_per_msg,
            Measure::Consumed => f.relay.map_or(f.rate, |r| r.consumed_rate),
        };
        let over = self.figures.get(r.over)?;
        let under: Vec<&Vec<Figures>> = r
            .under
            .iter()
            .map(|a| self.figures.get(*a))
            .collect::<Option<_>>()?;
        let reps = under.iter().map(|u| u.len()).fold(over.len(), usize::min);
        let values = (0..reps)
            .map(|i| {
                let below = under
                    .iter()
                    .map(|u| figure(&u[i]))
                    .fold(f64::INFINITY, f64::min);
                figure(&over[i]) / below
            })
            .collect();
        Spread::of(values)
    }

    /// The `+ outbox` arms' consumption rate (up to the last ack; the table's rate runs to the
    /// last event relayed), the share of the events relayed by then, and how long after the
    /// last ack the last event was confirmed.
    fn print_relays(&self) {
        let relayed: Vec<(&String, Vec<_>)> = self
            .arms
            .iter()
            .filter_map(|arm| {
                let r: Vec<_> = self
                    .figures
                    .get(arm)?
                    .iter()
                    .filter_map(|f| f.relay)
                    .collect();
                (!r.is_empty()).then_some((arm, r))
            })
            .collect();
        if relayed.is_empty() {
            return;
        }
        println!(
            "\n{:<30} {:>26} {:>22} {:>32}",
            "outbox arm",
            "acked msgs/s [min, max]",
            "relayed at last ack",
            "last event after last ack, ms"
        );
        for (arm, r) in relayed {
            let spread = |g: fn(&RelayFigures) -> f64| Spread::of(r.iter().map(g).collect());
            let (Some(rate), Some(share), Some(tail)) = (
                spread(|r| r.consumed_rate),
                spread(|r| r.relayed_at_ack),
                spread(|r| r.tail_ms),
            ) else {
                continue;
            };
            println!(
                "{arm:<30} {:>26} {:>22} {:>32}",
                format!("{rate:.0}"),
                format!("{share:.2}"),
                format!("{tail:.0}")
            );
        }
    }

    /// The arms' table and the ratios, as `bench` prints them at the end of a run.
    pub(crate) fn print(&self, cores: usize) {
        println!(
            "{:<30} {:>26} {:>22} {:>7} {:>7} {:>8} {:>7} {:>7} {:>8}",
            "arm",
            "msgs/s [min, max]",
            "CPU µs [min, max]",
            "PG µs",
            "broker",
            "all/slot",
            "p50 ms",
            "p99 ms",
            "ΔRSS MiB"
        );
        for arm in &self.arms {
            let Some(f) = self.figures.get(arm) else {
                continue;
            };
            let m = |g: fn(&Figures) -> f64| self.spread(arm, g).map_or(0.0, |s| s.median);
            let (Some(rate), Some(cpu)) = (
                self.spread(arm, |f| f.rate),
                self.spread(arm, |f| f.cpu_us_per_msg),
            ) else {
                continue;
            };
            let (pg, broker) = (m(|f| f.server_us_per_msg), m(|f| f.broker_us_per_msg));
            // The CPU all three spent per message over the CPU the machine had per message
            // at this rate: near 1.00, the arm is bound by the machine's cores, not by
            // waiting.
            let slot = cores as f64 * 1e6 / rate.median;
            let lat = |v: f64| {
                if f.iter().any(|f| f.measured_latency) {
                    format!("{v:.1}")
                } else {
                    "-".to_owned()
                }
            };
            println!(
                "{:<30} {:>26} {:>22} {:>7.1} {:>7.1} {:>8.2} {:>7} {:>7} {:>8.1}",
                arm,
                format!("{rate:.0}"),
                format!("{cpu:.1}"),
                pg,
                broker,
                (cpu.median + pg + broker) / slot,
                lat(m(|f| f.p50_ms)),
                lat(m(|f| f.p99_ms)),
                m(|f| f.rss_mib),
            );
        }
        self.print_relays();
        println!("\n{:<44}   median [min, max] over the repetitions", "ratio");
        for r in RATIOS {
            if let Some(s) = self.ratio(r) {
                println!("{:<44} = {s:.2}", r.label);
            }
        }
    }
}
