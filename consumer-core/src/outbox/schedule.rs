//! When a relay's run loop begins its next round: as soon as one may (a round filled its
//! batch, or a wake-up came) and fewer than its limit are in progress, one taking at a time;
//! or, for rows its take left behind an earlier round's row of their key, when an earlier
//! round ends.

/// What a round's take found, told to the run loop as soon as it is known, so that the
/// next round takes while this one publishes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Took {
    /// The round's number in its relay's run.
    pub(super) round: u64,
    /// The take filled the batch: more rows may be due now.
    pub(super) full: bool,
    /// Rows were left behind an earlier row of their key that another round (or relay)
    /// holds: they are due once that round has marked it.
    pub(super) held_back: bool,
}

/// When the next round begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// As soon as a round may begin: rows may be due.
    Now,
    /// When a round that began before round `.0` ends: rows wait behind it.
    AfterRound(u64),
    /// At the next wake-up or poll.
    Wakeup,
}

/// The rounds of a relay's run: how many are in progress, and when the next begins.
#[derive(Debug)]
pub(super) struct Schedule {
    next: Next,
    /// Rounds begun so far (the next round's number).
    begun: u64,
    /// Rounds begun and not ended.
    running: usize,
    /// Rounds ended so far.
    ended: u64,
    /// Rounds that had ended when the newest began.
    ended_before_newest: u64,
    /// Whether the newest round has yet to tell what its take found.
    taking: bool,
    /// Rounds in progress at most.
    most: usize,
}

impl Schedule {
    /// No round yet, the first due at once; at most `most` in progress.
    pub(super) fn new(most: usize) -> Self {
        Schedule {
            next: Next::Now,
            begun: 0,
            running: 0,
            ended: 0,
            ended_before_newest: 0,
            taking: false,
            most,
        }
    }

    /// Whether a round may begin now.
    pub(super) fn may_begin(&self) -> bool {
        self.next == Next::Now && !self.taking && self.running < self.most
    }

    /// Whether the loop waits for a wake-up or a poll (rather than for a round).
    pub(super) fn waits(&self) -> bool {
        self.next != Next::Now
    }

    /// Whether no round is in progress and none is due: the relay waits for a wake-up.
    pub(super) fn idle(&self) -> bool {
        self.next == Next::Wakeup && self.running == 0
    }

    /// A round begins; its number.
    pub(super) fn begin(&mut self) -> u64 {
        let round = self.begun;
        self.begun += 1;
        self.running += 1;
        self.ended_before_newest = self.ended;
        self.taking = true;
        self.next = Next::Wakeup;
        round
    }

    /// The newest round's take found `took`. Rows it left behind another round's wait for
    /// an earlier round to end; if one ended while it took, at once (that round may have
    /// been the one); if none was in progress, another relay holds them: for a wake-up.
    pub(super) fn took(&mut self, took: Took) {
        self.taking = false;
        let earlier_ended = self.ended > self.ended_before_newest;
        let earlier_running = self.running > 1;
        self.next = match self.next {
            _ if took.full => Next::Now,
            _ if took.held_back && earlier_ended => Next::Now,
            Next::Wakeup if took.held_back && earlier_running => Next::AfterRound(took.round),
            Next::AfterRound(r) if took.held_back => Next::AfterRound(r.max(took.round)),
            other => other,
        };
    }

    /// Round `round` ended.
    pub(super) fn ended(&mut self, round: u64) {
        self.running -= 1;
        self.ended += 1;
        if matches!(self.next, Next::AfterRound(r) if round < r) {
            self.next = Next::Now;
        }
    }

    /// A wake-up or a poll: rows may be due.
    pub(super) fn wake(&mut self) {
        self.next = Next::Now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn took(round: u64, full: bool, held_back: bool) -> Took {
        Took {
            round,
            full,
            held_back,
        }
    }

    #[test]
    fn a_full_take_lets_the_next_round_begin_up_to_the_limit() {
        let mut s = Schedule::new(2);
        assert!(s.may_begin());
        let first = s.begin();
        assert!(!s.may_begin(), "one round takes at a time");
        s.took(took(first, true, false));
        assert!(s.may_begin());
        let second = s.begin();
        s.took(took(second, true, false));
        assert!(!s.may_begin(), "two rounds in progress");
        s.ended(first);
        assert!(s.may_begin());
    }

    #[test]
    fn a_take_that_did_not_fill_its_batch_waits_for_a_wake_up() {
        let mut s = Schedule::new(2);
        let first = s.begin();
        s.took(took(first, false, false));
        s.ended(first);
        assert!(!s.may_begin() && s.waits() && s.running == 0);
        s.wake();
        assert!(s.may_begin());
    }

    #[test]
    fn rows_left_behind_an_earlier_round_are_looked_for_when_it_ends_not_when_their_own_does() {
        let mut s = Schedule::new(2);
        let first = s.begin();
        s.took(took(first, true, false));
        let second = s.begin();
        s.took(took(second, false, true));
        s.ended(second);
        assert!(!s.may_begin(), "the round they wait behind is in progress");
        s.ended(first);
        assert!(s.may_begin());
    }

    #[test]
    fn rows_left_behind_a_round_that_ended_while_they_were_taken_are_looked_for_at_once() {
        let mut s = Schedule::new(2);
        let first = s.begin();
        s.took(took(first, true, false));
        let second = s.begin();
        s.ended(first);
        s.took(took(second, false, true));
        assert!(s.may_begin());
    }

    #[test]
    fn rows_left_behind_another_relays_round_wait_for_a_wake_up() {
        let mut s = Schedule::new(2);
        let first = s.begin();
        s.took(took(first, false, true));
        s.ended(first);
        assert!(!s.may_begin(), "no earlier round of this relay holds them");
    }
}
