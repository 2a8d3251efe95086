//! Acking a batch's deliveries together ([`Acknowledger::ack_with`]): the pieces a transport
//! or a wrapper overrides it with (the default, which settles each delivery on its own, is
//! [`crate::transport::settle_each`], beside the trait).

use std::any::Any;

use futures::future::BoxFuture;
use futures::FutureExt;

use crate::delivery::{AckResults, Acknowledger};
use crate::error::TransportError;

/// `acker` as the acknowledger type `T` it is, or back as it was: for an
/// [`Acknowledger::ack_with`] that settles the deliveries of its own kind together.
pub fn downcast_acker<T: Acknowledger>(
    acker: Box<dyn Acknowledger>,
) -> Result<Box<T>, Box<dyn Acknowledger>> {
    if !(&*acker as &dyn Any).is::<T>() {
        return Err(acker);
    }
    let any: Box<dyn Any> = acker;
    // Checked just above: this downcast cannot fail.
    any.downcast::<T>()
        .map_err(|_| unreachable!("an acknowledger checked to be the type it is cast to"))
}

/// [`Acknowledger::ack_with`] for a transport that acks several of its deliveries in one
/// step: `first` and those of `others` that are `T`s and go `together` with it (the same
/// channel, the same consumer) are acked by `ack_run`, which returns one result each, in
/// the order given (`first` first); the rest of `others` are acked through their own
/// [`Acknowledger::ack_with`]. The results come back in the batch's order.
pub fn ack_together<T: Acknowledger>(
    first: Box<T>,
    others: Vec<Box<dyn Acknowledger>>,
    together: impl Fn(&T, &T) -> bool,
    ack_run: impl FnOnce(Vec<Box<T>>) -> BoxFuture<'static, AckResults>,
) -> BoxFuture<'static, AckResults> {
    let mut run = Vec::with_capacity(1 + others.len());
    run.push(first);
    // Where each of `others` goes: in `run` (`true`) or in `apart`, in order.
    let mut in_run = Vec::with_capacity(others.len());
    let mut apart = Vec::new();
    for other in others {
        match downcast_acker::<T>(other) {
            Ok(own) if together(&run[0], &own) => {
                in_run.push(true);
                run.push(own);
            }
            Ok(own) => {
                in_run.push(false);
                apart.push(own as Box<dyn Acknowledger>);
            }
            Err(other) => {
                in_run.push(false);
                apart.push(other);
            }
        }
    }
    let run = ack_run(run);
    let apart = (!apart.is_empty()).then(|| {
        let rest = apart.split_off(1);
        apart.swap_remove(0).ack_with(rest)
    });
    let merge = move |run: AckResults, apart: AckResults| {
        let (mut run, mut apart) = (run.into_iter(), apart.into_iter());
        let missing = || Err(TransportError::msg("no result for this delivery"));
        let first = run.next().unwrap_or_else(missing);
        std::iter::once(first)
            .chain(in_run.into_iter().map(|in_run| {
                let next = if in_run { run.next() } else { apart.next() };
                next.unwrap_or_else(missing)
            }))
            .collect()
    };
    match apart {
        None => Box::pin(run.map(move |run| merge(run, Vec::new()))),
        Some(apart) => {
            Box::pin(futures::future::join(run, apart).map(move |(run, apart)| merge(run, apart)))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::delivery::{settled_now, Settlement};

    /// Settles at once, refusing if it was built so, and records what it was asked.
    struct Probe {
        id: usize,
        refuse: bool,
        log: Arc<std::sync::Mutex<Vec<(usize, &'static str)>>>,
    }

    impl Acknowledger for Probe {
        fn settle(
            self: Box<Self>,
            s: Settlement,
        ) -> BoxFuture<'static, Result<(), TransportError>> {
            let what = if matches!(s, Settlement::Ack) {
                "ack"
            } else {
                "other"
            };
            self.log.lock().expect("log").push((self.id, what));
            if self.refuse {
                return Box::pin(std::future::ready(Err(TransportError::msg("refused"))));
            }
            // Not applied at the first poll: the default joins it.
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(())
            })
        }
    }

    struct Other;

    impl Acknowledger for Other {
        fn settle(
            self: Box<Self>,
            _: Settlement,
        ) -> BoxFuture<'static, Result<(), TransportError>> {
            settled_now()
        }
    }

    #[tokio::test]
    async fn acking_together_by_default_acks_each_with_its_own_result_in_order() {
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let probe = |id, refuse| {
            Box::new(Probe {
                id,
                refuse,
                log: log.clone(),
            })
        };
        let others: Vec<Box<dyn Acknowledger>> =
            vec![probe(1, true), Box::new(Other), probe(3, false)];
        let results = probe(0, false).ack_with(others).await;
        let refused: Vec<bool> = results.iter().map(Result::is_err).collect();
        assert_eq!(refused, [false, true, false, false]);
        assert_eq!(
            *log.lock().expect("log"),
            [(0, "ack"), (1, "ack"), (3, "ack")]
        );
    }

    /// Acks the members of its group as one run (recording the run), refusing id 2.
    struct Member {
        group: u8,
        id: usize,
        runs: Arc<std::sync::Mutex<Vec<Vec<usize>>>>,
    }

    impl Acknowledger for Member {
        fn settle(
            self: Box<Self>,
            _: Settlement,
        ) -> BoxFuture<'static, Result<(), TransportError>> {
            panic!("a member is acked in a run");
        }

        fn ack_with(
            self: Box<Self>,
            others: Vec<Box<dyn Acknowledger>>,
        ) -> BoxFuture<'static, AckResults> {
            let same_group = |a: &Member, b: &Member| a.group == b.group;
            ack_together(self, others, same_group, |run| {
                let ids: Vec<usize> = run.iter().map(|m| m.id).collect();
                let results = ids
                    .iter()
                    .map(|&id| {
                        if id == 2 {
                            Err(TransportError::msg("refused"))
                        } else {
                            Ok(())
                        }
                    })
                    .collect();
                run[0].runs.lock().expect("runs").push(ids);
                Box::pin(std::future::ready(results))
            })
        }
    }

    #[tokio::test]
    async fn acking_together_runs_each_group_once_and_keeps_the_batch_order() {
        let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let member = |group, id| -> Box<Member> {
            Box::new(Member {
                group,
                id,
                runs: runs.clone(),
            })
        };
        let others: Vec<Box<dyn Acknowledger>> = vec![
            member(b'b', 1),
            Box::new(Other),
            member(b'a', 2),
            member(b'b', 3),
            member(b'a', 4),
        ];
        let results = member(b'a', 0).ack_with(others).await;
        let refused: Vec<bool> = results.iter().map(Result::is_err).collect();
        assert_eq!(refused, [false, false, false, true, false, false]);
        assert_eq!(*runs.lock().expect("runs"), [vec![0, 2, 4], vec![1, 3]]);
    }

    #[test]
    fn an_acknowledger_casts_to_its_own_type_only() {
        let other: Box<dyn Acknowledger> = Box::new(Other);
        let Err(other) = downcast_acker::<Probe>(other) else {
            panic!("an Other cast to a Probe");
        };
        assert!(downcast_acker::<Other>(other).is_ok());
    }
}
