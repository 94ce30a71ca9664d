//! The protocol of one key, as a model a checker explores exhaustively: a client's attempts,
//! each handled by one of two instances, against the key's records in a store (one placement;
//! two while a service moves between placements: its namings, `Hashing::moving_to`, or its
//! region lists, `RegionalStore::moving_to`, whose transition is the same code; and the
//! names alongside it replaced, as a negative control), with every fault interleaved
//! everywhere (a claim's reply lost or late, an instance crashed or paused at any step, a
//! lease that lapses, a commit's reply lost, a complete's lost before or after it applied).
//!
//! The store's operations are atomic, each with its fences: `claim` (a fresh claim, a
//! takeover of a lapsed lease, "in progress", a replay), `complete`, `release` and `touch` (a
//! renewal, or the end of a lease) fenced by the owner token, `abandon` (a claim whose reply
//! its caller never saw: its lease ended by a touch when it landed, a marker when not yet). The engine's decisions:
//! a claim answered "in progress" is asked again once (the wait), then answered 202; a claim
//! answered too late to hold its lease is abandoned; a won claim runs the handler, after a look
//! at the names alongside when its deploy has them; the handler's outcome is settled by
//! `complete` (tried again while held), or committed in the store's own transaction
//! (`PostgresStore::transaction`), which holds the key by its session's lock from before its
//! `BEGIN` to after its `COMMIT`.
//!
//! Time is not modelled, only what it does: a lease lapses when its holder does not renew it,
//! that is when its instance crashed or is paused (faults: the holder is then *excused*, as
//! GUARANTEES.md's "handler outlives the keep-alive ceiling (or its process dies)" row allows
//! it a second run), and while a transaction that writes the record runs (renewals pause
//! there: not a fault, so a second run then is a violation).

use stateright::{Model, Property};

/// Attempts of one request (the original and its retries).
pub(crate) const ATTEMPTS: usize = 3;
/// Instances that serve them.
pub(crate) const INSTANCES: usize = 2;
/// The request's names: the old naming's and the new one's.
pub(crate) const NAMES: usize = 2;
/// Claims an attempt makes before it answers 202: the first, and one after its wait.
const CLAIMS: u8 = 2;

/// Which of today's fences and decisions the model has: each `false` is a negative control
/// (an older protocol, or a fence removed) that must give a counterexample.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Protocol {
    /// The handler commits its outcome in the store's transaction (else: `complete`).
    pub(crate) transactional: bool,
    /// The transaction holds its key by its session's lock while it runs (else: the lease,
    /// not renewed while it runs, lapses and may be taken over: issue 62's double run).
    pub(crate) key_lock: bool,
    /// `complete` is fenced by the owner token (and refuses a completed record).
    pub(crate) complete_fenced: bool,
    /// `release` is fenced by the owner token.
    pub(crate) release_fenced: bool,
    /// `touch` (the renewal, and the abandon that ends a landed claim's lease: a zero lease)
    /// is fenced by the owner token: an abandon ends its own claim's lease, never another's.
    pub(crate) touch_fenced: bool,
    /// A `complete` whose reply was lost is tried again while the claim is held.
    pub(crate) settle_retried: bool,
    /// An abandoned claim that was never applied leaves a marker that refuses it, landing late.
    pub(crate) abandon_marker: bool,
    /// A claim answered too late to hold its lease (its process paused with the answer on the
    /// wire) is abandoned, not run (`engine::heard_in_time`).
    pub(crate) late_claim_bound: bool,
    /// A transition build's transaction commits every name it holds in its one commit (else:
    /// only the one it claimed first).
    pub(crate) commit_both: bool,
    /// Where the instances keep the key: one placement, or a move between two.
    pub(crate) placement: Placement,
}

/// Where a service's instances keep the key, while it moves between two placements (names,
/// homes) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// One placement, every instance alike.
    Fixed,
    /// Today's `Hashing::alongside`: instance 0 is deploy 0 (the old names alone), instance 1
    /// deploy 1 (claims the old names, then looks at the new ones).
    Alongside,
    /// The transition (issue 64): instance 0 and instance 1 run these builds.
    Transition(Build, Build),
}

/// A build of the transition between two placements (issue 64), the old one 0 and the new 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Build {
    /// The old placement alone.
    Old,
    /// Claims the old placement, then the new, and holds both; completes the old first (its
    /// neighbour, `Old`, reads only that one); replays from either.
    First,
    /// As `First`, but completes the new placement first (its neighbour, `New`, reads only that
    /// one).
    Second,
    /// The new placement alone.
    New,
    /// Deploy 1 of today's `Hashing::alongside`: claims the old names, then looks at the new.
    Deploy1,
}

impl Build {
    /// The name it claims first, and the one it claims after (held with it), if any.
    fn claims(self) -> (u8, Option<u8>) {
        match self {
            Self::Old | Self::Deploy1 => (0, None),
            Self::First | Self::Second => (0, Some(1)),
            Self::New => (1, None),
        }
    }

    /// The order it completes the names it holds in.
    fn completes(self) -> &'static [u8] {
        match self {
            Self::First => &[0, 1],
            Self::Second => &[1, 0],
            Self::Old | Self::Deploy1 | Self::New => &[],
        }
    }
}

impl Protocol {
    /// The protocol as the code runs it, outside a move between namings.
    pub(crate) const TODAY: Self = Self {
        transactional: false,
        key_lock: true,
        complete_fenced: true,
        release_fenced: true,
        touch_fenced: true,
        settle_retried: true,
        abandon_marker: true,
        late_claim_bound: true,
        commit_both: true,
        placement: Placement::Fixed,
    };

    /// The build an instance runs.
    fn build(self, instance: u8) -> Build {
        match (self.placement, instance) {
            (Placement::Fixed, _) | (Placement::Alongside, 0) => Build::Old,
            (Placement::Alongside, _) => Build::Deploy1,
            (Placement::Transition(first, _), 0) => first,
            (Placement::Transition(_, second), _) => second,
        }
    }
}

/// A record of the key in the store, under one of its names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Record {
    Absent,
    /// In progress, held by `owner` (an attempt's token); `live` while its lease runs.
    Held {
        owner: u8,
        live: bool,
    },
    /// Completed with the response of `owner`'s run.
    Done {
        owner: u8,
    },
    /// An abandoned claim's marker: `owner`'s claim, landing late, is refused.
    Marker {
        owner: u8,
    },
}

/// Where one attempt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// Not sent yet, or about to claim again after a wait (`claims` made so far).
    Ready {
        claims: u8,
    },
    /// The claim is on the wire, not applied yet.
    Claiming {
        claims: u8,
    },
    /// The claim was applied; its reply is on the wire.
    Replied {
        claims: u8,
        reply: Reply,
    },
    /// The caller gave up on a claim whose reply it never saw: its guard abandons it.
    Abandoning,
    /// Its own name won, about to claim the names alongside for a moment.
    Looking,
    /// The names alongside claimed: what they held decides.
    Looked(Reply),
    /// The claim was won: the handler runs (before its transaction, if any).
    Running,
    /// The handler's transaction runs (its key lock taken, the lease renewed).
    InTransaction,
    /// The door settles: `complete` sent (the client has its answer).
    Completing,
    Answered(Answer),
    /// The instance died: nothing more of this attempt.
    Crashed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Reply {
    Claimed,
    TakenOver,
    InProgress,
    Replay(u8),
    Refused,
}

/// What the client was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Answer {
    /// The response of the run of `0` (its own, or replayed).
    Response(u8),
    /// 202: in progress, ask again.
    InProgress,
    /// 503: nothing stored for it; a retry learns the truth.
    Unavailable,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct State {
    pub(crate) records: [Record; NAMES],
    /// The attempt whose transaction's session holds each name's key lock.
    pub(crate) lock: [Option<u8>; NAMES],
    pub(crate) steps: [Step; ATTEMPTS],
    /// The instance each attempt was sent to (`None`: not yet).
    pub(crate) instance: [Option<u8>; ATTEMPTS],
    /// The name each attempt claims, and runs under.
    pub(crate) under: [u8; ATTEMPTS],
    /// The attempts that hold the second placement too (a transition build's).
    pub(crate) both: [bool; ATTEMPTS],
    /// How many of its names an attempt completed (a transition build completes two).
    pub(crate) completed: [u8; ATTEMPTS],
    /// Instances paused (a stop of the world, a VM pause): nothing of theirs happens.
    pub(crate) paused: [bool; INSTANCES],
    /// Attempts that lost their lease to a fault of their own (a crash, a pause): a second
    /// run is allowed them (GUARANTEES.md, "handler outlives the keep-alive ceiling (or its
    /// process dies)").
    pub(crate) excused: [bool; ATTEMPTS],
    /// Claims given up on while still on the wire: they may land after their abandon.
    pub(crate) late: [bool; ATTEMPTS],
    /// Claims whose lease lapsed while their answer was on the wire: answered too late.
    pub(crate) stale: [bool; ATTEMPTS],
    /// Faults left to inject (crash, pause, lost reply): a bound, so that every path ends.
    pub(crate) faults: u8,
    /// A run began while another attempt's run was going on, not excused.
    pub(crate) ran_beside_a_live_holder: bool,
    /// A run began after a response was stored (under any name).
    pub(crate) ran_after_stored: bool,
    /// The response each attempt's claim found stored (its owner), when it found one.
    pub(crate) found_stored: [Option<u8>; ATTEMPTS],
    /// Attempts whose claim's reply their caller never heard (given up on).
    pub(crate) gave_up: [bool; ATTEMPTS],
    /// Attempts whose abandon found the key free (absent, or a marker).
    pub(crate) freed: [bool; ATTEMPTS],
    /// A claim given up on while the key was free landed after its abandon, and holds the key
    /// (nobody runs under it: every attempt meanwhile is answered 202, for a lease).
    pub(crate) held_after_abandon: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    Send {
        attempt: u8,
        instance: u8,
    },
    Land(u8),
    LandLate(u8),
    Receive(u8),
    GiveUp(u8),
    Abandon(u8),
    Look(u8),
    Decide(u8),
    Begin(u8),
    Commit {
        attempt: u8,
        reply_lost: bool,
    },
    Settle(u8),
    Complete {
        attempt: u8,
        reply_lost: bool,
    },
    /// A `complete` applied by the store, its reply lost: tried again while held.
    CompleteAppliedLost(u8),
    Lapse(u8),
    Crash(u8),
    Pause(u8),
    Resume(u8),
}

#[derive(Clone, Debug)]
pub(crate) struct OneKey {
    pub(crate) protocol: Protocol,
    pub(crate) faults: u8,
}

impl OneKey {
    fn running(state: &State, attempt: usize) -> bool {
        matches!(state.steps[attempt], Step::Running | Step::InTransaction | Step::Completing)
    }

    /// Whether the record under `name`, held by `owner`, may lapse now: its instance crashed
    /// or is paused; nobody renews it (its attempt was answered, or runs under the other name,
    /// or its claim landed after it was abandoned); or its transaction runs (renewals pause
    /// there). A claim just made (its reply on the wire, or the look's) has a whole lease
    /// ahead, and a running holder renews it.
    fn may_lapse(state: &State, owner: usize, name: u8) -> bool {
        let instance = state.instance[owner].map(usize::from);
        let faulted = instance.is_some_and(|i| state.paused[i]);
        let fresh =
            matches!(state.steps[owner], Step::Replied { .. } | Step::Looking | Step::Looked(_));
        let holds = state.under[owner] == name || (state.both[owner] && name == 1);
        let renewed = Self::running(state, owner) && holds;
        faulted || !(fresh || renewed) || state.steps[owner] == Step::InTransaction
    }

    /// The names `attempt` holds: the one it claimed, and the second placement's in a
    /// transition build.
    fn held_names(state: &State, a: usize) -> Vec<u8> {
        let first = state.under[a];
        if state.both[a] { vec![first, 1 - first] } else { vec![first] }
    }

    /// Notes the response `attempt`'s claim of `name` finds stored there, if any.
    fn sees_stored(state: &mut State, a: usize, name: u8) {
        if let Record::Done { owner } = state.records[usize::from(name)] {
            state.found_stored[a].get_or_insert(owner);
        }
    }

    /// The store's claim of `name`, applied atomically for `attempt`.
    fn claim(&self, state: &mut State, name: u8, attempt: u8) -> Reply {
        let n = usize::from(name);
        let token = attempt;
        match state.records[n] {
            Record::Marker { owner } if owner == token => Reply::Refused,
            // An abandoned claim's marker is absent for every other claim.
            Record::Absent | Record::Marker { .. } => {
                state.records[n] = Record::Held { owner: token, live: true };
                Reply::Claimed
            }
            Record::Done { owner } => Reply::Replay(owner),
            Record::Held { live: true, .. } => Reply::InProgress,
            Record::Held { owner, live: false } => {
                if self.protocol.key_lock && state.lock[n] == Some(owner) {
                    return Reply::InProgress;
                }
                state.records[n] = Record::Held { owner: token, live: true };
                Reply::TakenOver
            }
        }
    }

    /// A run of the handler begins for `attempt`: checked against the runs going on.
    fn run(state: &mut State, attempt: usize) -> Step {
        if state.records.iter().any(|record| matches!(record, Record::Done { .. })) {
            state.ran_after_stored = true;
        }
        // A holder whose lease lapsed to a fault of its own (paused with its claim's reply on
        // the wire) runs in the window the guarantees allow, beside whoever took it over.
        let beside = !state.excused[attempt]
            && (0..ATTEMPTS).any(|other| {
                other != attempt && Self::running(state, other) && !state.excused[other]
            });
        state.ran_beside_a_live_holder |= beside;
        Step::Running
    }

    fn release(&self, state: &mut State, name: u8, attempt: u8) {
        let n = usize::from(name);
        match state.records[n] {
            Record::Held { owner, .. } if owner == attempt || !self.protocol.release_fenced => {
                state.records[n] = Record::Absent;
            }
            _ => {}
        }
    }

    fn unlock(state: &mut State, name: u8, attempt: u8) {
        if state.lock[usize::from(name)] == Some(attempt) {
            state.lock[usize::from(name)] = None;
        }
    }

    /// What an attempt whose claim was answered `reply` does next.
    fn received(&self, state: &mut State, a: usize, claims: u8, reply: Reply) -> Step {
        let looks = state.instance[a].is_some_and(|i| {
            let build = self.protocol.build(i);
            build == Build::Deploy1 || build.claims().1.is_some()
        });
        match reply {
            Reply::Claimed | Reply::TakenOver
                if state.stale[a] && self.protocol.late_claim_bound =>
            {
                Step::Abandoning
            }
            Reply::Claimed | Reply::TakenOver if looks => Step::Looking,
            Reply::Claimed | Reply::TakenOver => Self::run(state, a),
            Reply::Replay(owner) => Step::Answered(Answer::Response(owner)),
            Reply::InProgress if claims < CLAIMS => Step::Ready { claims },
            Reply::InProgress => Step::Answered(Answer::InProgress),
            Reply::Refused => Step::Answered(Answer::Unavailable),
        }
    }

    /// A transition build's decision, once the second placement answered `reply` to the
    /// claim it makes after winning the first: both held, and the handler run; a response
    /// stored there replayed, and written to the first too (so that a build that reads only the
    /// first replays it as well); the first let go otherwise.
    fn hold_both(&self, state: &mut State, a: usize, reply: Reply) -> Step {
        let attempt = a as u8;
        let first = state.under[a];
        if state.stale[a] && self.protocol.late_claim_bound {
            // Both claims made, but too late to hold the first's lease (counted from the
            // first's sending): both let go, fenced, and nothing run.
            self.release(state, first, attempt);
            self.release(state, 1 - first, attempt);
            return Step::Answered(Answer::Unavailable);
        }
        match reply {
            Reply::Claimed | Reply::TakenOver => {
                state.both[a] = true;
                Self::run(state, a)
            }
            Reply::Replay(owner) => {
                let n = usize::from(first);
                if matches!(state.records[n], Record::Held { owner: held, .. } if held == attempt) {
                    state.records[n] = Record::Done { owner };
                }
                Step::Answered(Answer::Response(owner))
            }
            Reply::InProgress => {
                self.release(state, first, attempt);
                Step::Answered(Answer::InProgress)
            }
            Reply::Refused => {
                self.release(state, first, attempt);
                Step::Answered(Answer::Unavailable)
            }
        }
    }

    /// The look's decision (`Hashing::alongside` today), once the names alongside answered
    /// `reply` to a claim of theirs made for a moment.
    fn decide(&self, state: &mut State, a: usize, reply: Reply) -> Step {
        let attempt = a as u8;
        let own = state.under[a];
        let other = 1 - own;
        match reply {
            // Nothing there: let go of it, and run under our own names.
            Reply::Claimed => {
                self.release(state, other, attempt);
                Self::run(state, a)
            }
            // A lapsed holder there: taken over under those names, and run there; our own
            // claim is handed back with its lapse.
            Reply::TakenOver => {
                if let Record::Held { owner, .. } = state.records[usize::from(own)]
                    && owner == attempt
                {
                    state.records[usize::from(own)] = Record::Held { owner, live: false };
                }
                state.under[a] = other;
                Self::run(state, a)
            }
            Reply::InProgress => {
                self.release(state, own, attempt);
                Step::Answered(Answer::InProgress)
            }
            Reply::Replay(owner) => {
                self.release(state, own, attempt);
                Step::Answered(Answer::Response(owner))
            }
            Reply::Refused => {
                self.release(state, own, attempt);
                Step::Answered(Answer::Unavailable)
            }
        }
    }
}

/// Whether a `complete`'s reply reached its caller: lost before the store applied it, or after.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lost {
    No,
    Before,
    After,
}

impl OneKey {
    /// `attempt`'s next `complete` (the next of the names it holds, in its build's order).
    fn complete(&self, state: &mut State, attempt: u8, lost: Lost) {
        let a = usize::from(attempt);
        let order = state.instance[a].map_or(&[][..], |i| self.protocol.build(i).completes());
        let n = match (state.both[a], order.get(usize::from(state.completed[a]))) {
            (true, Some(name)) => usize::from(*name),
            _ => usize::from(state.under[a]),
        };
        let applies = match state.records[n] {
            // Its own claim; or its own complete, applied before (its reply lost): applied, as
            // the stores answer. Another's, only without the fence.
            Record::Held { owner, .. } | Record::Done { owner } => {
                owner == attempt || !self.protocol.complete_fenced
            }
            // The lease lapsed and the record went, nobody took over: the stores keep the
            // response (the conformance kit holds them to it).
            Record::Absent | Record::Marker { .. } => true,
        };
        if lost != Lost::No {
            state.faults -= 1;
            if lost == Lost::After && applies {
                state.records[n] = Record::Done { owner: attempt };
            }
            // Its fate unknown: tried again while held, or given up.
            if !self.protocol.settle_retried {
                state.steps[a] = Step::Answered(Answer::Response(attempt));
            }
            return;
        }
        if applies {
            state.records[n] = Record::Done { owner: attempt };
        }
        state.completed[a] += 1;
        if state.both[a] && !applies {
            // Fenced out of one placement (taken over there): the response is not the key's,
            // and is written to no other; what it holds there is let go.
            for name in order.iter().skip(usize::from(state.completed[a])) {
                self.release(state, *name, attempt);
            }
            state.completed[a] = 2;
        }
        if !state.both[a] || usize::from(state.completed[a]) >= order.len() {
            state.steps[a] = Step::Answered(Answer::Response(attempt));
        }
    }
}

impl Model for OneKey {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            records: [Record::Absent; NAMES],
            lock: [None; NAMES],
            steps: [Step::Ready { claims: 0 }; ATTEMPTS],
            instance: [None; ATTEMPTS],
            under: [0; ATTEMPTS],
            both: [false; ATTEMPTS],
            completed: [0; ATTEMPTS],
            paused: [false; INSTANCES],
            excused: [false; ATTEMPTS],
            late: [false; ATTEMPTS],
            stale: [false; ATTEMPTS],
            faults: self.faults,
            ran_beside_a_live_holder: false,
            ran_after_stored: false,
            found_stored: [None; ATTEMPTS],
            gave_up: [false; ATTEMPTS],
            freed: [false; ATTEMPTS],
            held_after_abandon: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for a in 0..ATTEMPTS {
            let attempt = a as u8;
            if state.late[a] {
                actions.push(Action::LandLate(attempt));
            }
            let instance = state.instance[a].map(usize::from);
            if instance.is_some_and(|i| state.paused[i]) {
                continue;
            }
            let lossy = state.faults > 0;
            match state.steps[a] {
                Step::Ready { claims: 0 } => {
                    // Attempts are sent in order; each to either instance.
                    if a == 0 || state.instance[a - 1].is_some() {
                        for i in 0..INSTANCES {
                            actions.push(Action::Send { attempt, instance: i as u8 });
                        }
                    }
                }
                Step::Ready { .. } => actions.push(Action::Land(attempt)),
                Step::Claiming { .. } => {
                    actions.push(Action::Land(attempt));
                    if lossy {
                        actions.push(Action::GiveUp(attempt));
                    }
                }
                Step::Replied { .. } => {
                    actions.push(Action::Receive(attempt));
                    if lossy {
                        actions.push(Action::GiveUp(attempt));
                    }
                }
                Step::Abandoning => actions.push(Action::Abandon(attempt)),
                Step::Looking => actions.push(Action::Look(attempt)),
                Step::Looked(_) => actions.push(Action::Decide(attempt)),
                Step::Running if self.protocol.transactional => {
                    actions.push(Action::Begin(attempt));
                }
                Step::Running => actions.push(Action::Settle(attempt)),
                Step::InTransaction => {
                    actions.push(Action::Commit { attempt, reply_lost: false });
                    if lossy {
                        actions.push(Action::Commit { attempt, reply_lost: true });
                    }
                }
                Step::Completing => {
                    actions.push(Action::Complete { attempt, reply_lost: false });
                    if lossy {
                        actions.push(Action::Complete { attempt, reply_lost: true });
                        actions.push(Action::CompleteAppliedLost(attempt));
                    }
                }
                Step::Answered(_) | Step::Crashed => {}
            }
        }
        for name in 0..NAMES {
            if let Record::Held { owner, live: true } = state.records[name]
                && Self::may_lapse(state, usize::from(owner), name as u8)
            {
                actions.push(Action::Lapse(name as u8));
            }
        }
        for i in 0..INSTANCES {
            let instance = i as u8;
            let busy = (0..ATTEMPTS).any(|a| {
                state.instance[a] == Some(instance)
                    && !matches!(state.steps[a], Step::Answered(_) | Step::Crashed)
            });
            if state.faults > 0 && busy {
                actions.push(Action::Crash(instance));
                if !state.paused[i] {
                    actions.push(Action::Pause(instance));
                }
            }
            if state.paused[i] {
                actions.push(Action::Resume(instance));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Send { attempt, instance } => {
                let a = usize::from(attempt);
                state.instance[a] = Some(instance);
                state.under[a] = self.protocol.build(instance).claims().0;
                state.steps[a] = Step::Claiming { claims: 1 };
            }
            Action::Land(attempt) => {
                let a = usize::from(attempt);
                let claims = match state.steps[a] {
                    Step::Claiming { claims } => claims,
                    // A claim again after the wait: sent and applied at once.
                    Step::Ready { claims } => claims + 1,
                    _ => return None,
                };
                let name = state.under[a];
                Self::sees_stored(&mut state, a, name);
                let reply = self.claim(&mut state, name, attempt);
                state.steps[a] = Step::Replied { claims, reply };
            }
            Action::LandLate(attempt) => {
                // Applied, never heard: whatever it claimed, nobody runs under it.
                let a = usize::from(attempt);
                state.late[a] = false;
                let name = state.under[a];
                let reply = self.claim(&mut state, name, attempt);
                if state.freed[a] && matches!(reply, Reply::Claimed | Reply::TakenOver) {
                    state.held_after_abandon = true;
                }
            }
            Action::Receive(attempt) => {
                let a = usize::from(attempt);
                let Step::Replied { claims, reply } = state.steps[a] else { return None };
                state.steps[a] = self.received(&mut state, a, claims, reply);
            }
            Action::GiveUp(attempt) => {
                let a = usize::from(attempt);
                state.faults -= 1;
                state.gave_up[a] = true;
                // A claim still on the wire may land after its abandon.
                state.late[a] = matches!(state.steps[a], Step::Claiming { .. });
                state.steps[a] = Step::Abandoning;
            }
            Action::Abandon(attempt) => {
                let a = usize::from(attempt);
                let n = usize::from(state.under[a]);
                state.freed[a] = matches!(state.records[n], Record::Absent | Record::Marker { .. });
                match state.records[n] {
                    Record::Held { owner, .. } if owner == attempt => {
                        state.records[n] = Record::Absent;
                    }
                    Record::Absent if self.protocol.abandon_marker => {
                        state.records[n] = Record::Marker { owner: attempt };
                    }
                    // Its claim never landed, and another holds the key: an unfenced touch
                    // ends that holder's lease while it runs.
                    Record::Held { owner, .. } if !self.protocol.touch_fenced => {
                        state.records[n] = Record::Held { owner, live: false };
                    }
                    _ => {}
                }
                state.steps[a] = Step::Answered(Answer::Unavailable);
            }
            Action::Look(attempt) => {
                let a = usize::from(attempt);
                let other = 1 - state.under[a];
                Self::sees_stored(&mut state, a, other);
                let reply = self.claim(&mut state, other, attempt);
                state.steps[a] = Step::Looked(reply);
            }
            Action::Decide(attempt) => {
                let a = usize::from(attempt);
                let Step::Looked(reply) = state.steps[a] else { return None };
                let build = state.instance[a].map(|i| self.protocol.build(i));
                state.steps[a] = match build {
                    Some(Build::Deploy1) => self.decide(&mut state, a, reply),
                    _ => self.hold_both(&mut state, a, reply),
                };
            }
            Action::Begin(attempt) => {
                let a = usize::from(attempt);
                // Every name it holds (both, in a transition build), each by its lock, taken
                // in order: `PostgresStore::transaction` during `Hashing::moving_to`.
                let names = Self::held_names(&state, a);
                if self.protocol.key_lock {
                    if names.iter().any(|&name| state.lock[usize::from(name)].is_some()) {
                        return None;
                    }
                    for &name in &names {
                        state.lock[usize::from(name)] = Some(attempt);
                    }
                    // The lease renewed, fenced, under the lock: a holder taken over before is
                    // fenced out here, before anything is paid.
                    let ours = |record: Record| matches!(record, Record::Held { owner, .. } if owner == attempt);
                    if names.iter().all(|&name| ours(state.records[usize::from(name)])) {
                        for &name in &names {
                            state.records[usize::from(name)] =
                                Record::Held { owner: attempt, live: true };
                        }
                    } else {
                        for &name in &names {
                            Self::unlock(&mut state, name, attempt);
                            self.release(&mut state, name, attempt);
                        }
                        state.steps[a] = Step::Answered(Answer::Unavailable);
                        return Some(state);
                    }
                }
                state.steps[a] = Step::InTransaction;
            }
            Action::Commit { attempt, reply_lost } => {
                let a = usize::from(attempt);
                // Every name it holds, in the one commit: all of them fenced by its token, or
                // none written.
                let names = Self::held_names(&state, a);
                let written = if self.protocol.commit_both { &names[..] } else { &names[..1] };
                let committed = written.iter().all(|&name| {
                    matches!(state.records[usize::from(name)], Record::Held { owner, .. } if owner == attempt)
                });
                if committed {
                    for &name in written {
                        state.records[usize::from(name)] = Record::Done { owner: attempt };
                    }
                }
                if reply_lost {
                    state.faults -= 1;
                }
                for &name in &names {
                    Self::unlock(&mut state, name, attempt);
                }
                state.steps[a] = if committed && !reply_lost {
                    Step::Answered(Answer::Response(attempt))
                } else {
                    // Rolled back, or its fate unknown: a fenced release, which a committed
                    // record refuses; the retry learns the truth.
                    for &name in &names {
                        self.release(&mut state, name, attempt);
                    }
                    Step::Answered(Answer::Unavailable)
                };
            }
            Action::Settle(attempt) => {
                // The client has its answer with the first `complete` sent.
                state.steps[usize::from(attempt)] = Step::Completing;
            }
            Action::Complete { attempt, reply_lost } => {
                self.complete(
                    &mut state,
                    attempt,
                    if reply_lost { Lost::Before } else { Lost::No },
                );
            }
            Action::CompleteAppliedLost(attempt) => self.complete(&mut state, attempt, Lost::After),
            Action::Lapse(name) => {
                let n = usize::from(name);
                let Record::Held { owner, .. } = state.records[n] else { return None };
                let o = usize::from(owner);
                if state.instance[o].is_some_and(|i| state.paused[usize::from(i)]) {
                    state.excused[o] = true;
                }
                // A lease that lapses while its claims are still being made (an answer on the
                // wire, the second placement's claim): they come too late to hold it.
                let claiming = matches!(state.steps[o], Step::Replied { .. })
                    || (matches!(state.steps[o], Step::Looking | Step::Looked(_))
                        && state.instance[o]
                            .is_some_and(|i| self.protocol.build(i) != Build::Deploy1));
                if claiming {
                    state.stale[o] = true;
                }
                state.records[n] = Record::Held { owner, live: false };
            }
            Action::Crash(instance) => {
                // Its process dies (and a new one takes its place, for the attempts sent
                // after): its sessions end, their transactions roll back, the key's locks go.
                state.faults -= 1;
                state.paused[usize::from(instance)] = false;
                for a in 0..ATTEMPTS {
                    if state.instance[a] == Some(instance)
                        && !matches!(state.steps[a], Step::Answered(_) | Step::Crashed)
                    {
                        for name in 0..NAMES as u8 {
                            Self::unlock(&mut state, name, a as u8);
                        }
                        state.steps[a] = Step::Crashed;
                        state.excused[a] = true;
                        state.late[a] = false;
                    }
                }
            }
            Action::Pause(instance) => {
                state.faults -= 1;
                state.paused[usize::from(instance)] = true;
            }
            Action::Resume(instance) => state.paused[usize::from(instance)] = false,
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            // GUARANTEES.md, "handler longer than its lease": "no retry takes the key over";
            // and `PostgresStore::transaction` longer than its lease: "one run".
            Property::always("no second run beside a live holder", |_, state: &State| {
                !state.ran_beside_a_live_holder
            }),
            // GUARANTEES.md, "handler outlives the keep-alive ceiling (or its process dies)":
            // the first holder's response is fenced out; a stored response is replayed.
            Property::always("no run after a response was stored", |_, state: &State| {
                !state.ran_after_stored
            }),
            // GUARANTEES.md, "retry after the response was stored": "replayed"; no client is
            // answered another response than the one stored, unless its holder was excused.
            Property::always("every response answered is the one stored", |_, state: &State| {
                state.records.iter().all(|record| {
                    let Record::Done { owner } = *record else { return true };
                    state.steps.iter().enumerate().all(|(a, step)| match step {
                        Step::Answered(Answer::Response(r)) => *r == owner || state.excused[a],
                        _ => true,
                    })
                })
            }),
            // Once the faults are spent, every attempt is answered (nothing waits forever).
            Property::eventually("every attempt is answered", |_, state: &State| {
                state.steps.iter().all(|step| matches!(step, Step::Answered(_) | Step::Crashed))
            }),
            // Once every attempt is done and the faults are spent, the key is answered: a claim
            // made then (by a client retrying later) is won, taken over or replayed under every
            // name, never "in progress" or refused for good.
            Property::eventually(
                "the key is answered once every attempt is done",
                |model: &OneKey, state: &State| {
                    let done = state
                        .steps
                        .iter()
                        .all(|step| matches!(step, Step::Answered(_) | Step::Crashed));
                    done && (0..NAMES as u8).all(|name| {
                        let mut later = state.clone();
                        !matches!(
                            model.claim(&mut later, name, u8::MAX),
                            Reply::InProgress | Reply::Refused
                        )
                    })
                },
            ),
            // GUARANTEES.md, "retry after the response was stored": "replayed"; every attempt
            // whose claim finds a response stored is answered that response (unless its caller
            // gave up on the reply, or its instance failed it).
            Property::always(
                "every attempt that finds a response stored gets it",
                |_, state: &State| {
                    (0..ATTEMPTS).all(|a| match (state.found_stored[a], state.steps[a]) {
                        (Some(owner), Step::Answered(answer)) => {
                            answer == Answer::Response(owner)
                                || state.gave_up[a]
                                || state.excused[a]
                        }
                        _ => true,
                    })
                },
            ),
            // "No client is answered something other than what is, or will be, stored": once
            // every attempt is done, each response a client was told (but one whose holder was
            // excused) is the key's stored response.
            Property::eventually(
                "every response answered is stored in the end",
                |_, state: &State| {
                    let done = state
                        .steps
                        .iter()
                        .all(|step| matches!(step, Step::Answered(_) | Step::Crashed));
                    done && state.steps.iter().enumerate().all(|(a, step)| match step {
                        Step::Answered(Answer::Response(r)) => {
                            state.excused[a] || state.records.contains(&Record::Done { owner: *r })
                        }
                        _ => true,
                    })
                },
            ),
        ];
        // GUARANTEES.md, "Redis paused past the command timeout": a claim abandoned before it
        // landed "is refused when it does (by the abandon's marker)". With one fault, one
        // placement: with two, or during a move, another claim may take the key over the
        // marker and let it go before the late one lands, which then holds it for a lease
        // (a delay, no run; `tests/model.rs` shows the path).
        if self.faults <= 1 && self.protocol.placement == Placement::Fixed {
            properties.push(Property::always(
                "a claim given up on while the key was free never holds it",
                |_, state: &State| !state.held_after_abandon,
            ));
        }
        properties
    }
}
