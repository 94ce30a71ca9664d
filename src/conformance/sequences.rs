//! The store held to the protocol's model: random sequences of the model's store operations
//! (`tests/model/protocol.rs`: claim, takeover, complete, release, renewal, a lapse, abandon),
//! each reply compared with what the model's record answers.

use bytes::Bytes;

use super::{Keys, LONG, fp};
use crate::store::{Claim, Fenced, Lease, OwnerToken, Store};

/// The model's record of one key, as the store must keep it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    Absent,
    /// In progress, held by token `owner`; `live` while its lease runs.
    Held {
        owner: usize,
        live: bool,
    },
    /// Completed with `owner`'s response.
    Done {
        owner: usize,
    },
}

/// One operation of a sequence, on the key's `n`th token (a fresh one for a claim).
#[derive(Debug, Clone, Copy)]
enum Operation {
    Claim,
    /// A claim of another request (another payload) under the key.
    Stranger,
    Complete(usize),
    Release(usize),
    Renew(usize),
    /// The holder's lease lapses (its renewals stopped: a zero-lease renewal, kept for the
    /// recovery window).
    Lapse,
    Abandon(usize),
}

/// A small deterministic generator, seeded: a failing sequence is named by its seed.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: usize) -> usize {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let value = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        usize::try_from(value >> 33).unwrap_or(0) % sides.max(1)
    }
}

/// Sequences of the model's store operations, at random, each reply compared with the model's
/// record: 16 sequences of 24 operations over three tokens or more, a lapse a zero-lease
/// renewal (so that no answer depends on the clock of the test's host), every record kept for
/// a long recovery window.
///
/// # Panics
///
/// On the first reply the model does not give, naming the seed, the sequence so far and both
/// answers.
pub async fn random_sequences_agree_with_the_model<St: Store>(store: &St) {
    let seed: u64 = rand::random::<u64>() | 1;
    for sequence in 0..16 {
        agree(store, seed.wrapping_add(sequence * 2)).await;
    }
}

fn response(token: usize) -> Bytes {
    Bytes::from(format!("the response of run {token}"))
}

async fn agree<St: Store>(store: &St, seed: u64) {
    let key = Keys::new().key("sequence");
    let (request, stranger) = (fp("the request"), fp("another request"));
    let lease = Lease::new(LONG).recovery_window(LONG);
    let mut dice = Dice(seed);
    let mut tokens: Vec<OwnerToken> = Vec::new();
    let mut record = Record::Absent;
    let mut done = Vec::new();
    for _ in 0..24 {
        let pick = |dice: &mut Dice, tokens: &Vec<OwnerToken>| dice.roll(tokens.len());
        let operation = match (dice.roll(8), tokens.is_empty()) {
            (0 | 1, _) | (_, true) => Operation::Claim,
            (2, _) => Operation::Stranger,
            (3, _) => Operation::Complete(pick(&mut dice, &tokens)),
            (4, _) => Operation::Release(pick(&mut dice, &tokens)),
            (5, _) => Operation::Renew(pick(&mut dice, &tokens)),
            (6, _) => Operation::Lapse,
            _ => Operation::Abandon(pick(&mut dice, &tokens)),
        };
        done.push(operation);
        let said = |what: &dyn std::fmt::Debug, expected: &dyn std::fmt::Debug| {
            format!(
                "seed {seed}: after {done:?} from an absent key, the store answered {what:?} \
                 where the model answers {expected:?}"
            )
        };
        let held_by = |token: usize| matches!(record, Record::Held { owner, .. } if owner == token);
        match operation {
            Operation::Claim | Operation::Stranger => {
                let ours = matches!(operation, Operation::Claim);
                let (expected, next) = match (record, ours) {
                    (Record::Absent, true) => (Claim::Claimed, Some(tokens.len())),
                    // Never taken by another request: only asked.
                    (Record::Absent, false) => continue,
                    (_, false) => (Claim::Mismatch, None),
                    (Record::Held { live: true, .. }, true) => {
                        (Claim::InProgress { remaining: LONG }, None)
                    }
                    (Record::Held { live: false, .. }, true) => {
                        (Claim::TakenOver, Some(tokens.len()))
                    }
                    (Record::Done { owner }, true) => {
                        (Claim::Replay { response: response(owner), remaining: LONG }, None)
                    }
                };
                let token = OwnerToken::random();
                let asked = if ours { &request } else { &stranger };
                let answer = store.claim(&key, asked, &token, lease).await;
                let same = match (&answer, &expected) {
                    (Ok(Claim::InProgress { .. }), Claim::InProgress { .. }) => true,
                    (
                        Ok(Claim::Replay { response, .. }),
                        Claim::Replay { response: stored, .. },
                    ) => response == stored,
                    (Ok(answer), expected) => answer == expected,
                    (Err(_), _) => false,
                };
                assert!(same, "{}", said(&answer, &expected));
                tokens.push(token);
                if let Some(owner) = next {
                    record = Record::Held { owner, live: true };
                }
            }
            Operation::Complete(t) => {
                // The holder's own claim, a response it stored already, or an absent key (its
                // lease lapsed and its record went, nobody took over: its response is the one).
                let applies =
                    held_by(t) || record == Record::Done { owner: t } || record == Record::Absent;
                let completed = store.complete(&key, &tokens[t], &request, response(t), LONG);
                let answer = completed.await;
                let expected = if applies { Fenced::Applied } else { Fenced::Rejected };
                assert!(matches!(answer, Ok(a) if a == expected), "{}", said(&answer, &expected));
                if applies {
                    record = Record::Done { owner: t };
                }
            }
            Operation::Release(t) => {
                let answer = store.release(&key, &tokens[t]).await;
                let expected = if held_by(t) { Fenced::Applied } else { Fenced::Rejected };
                assert!(matches!(answer, Ok(a) if a == expected), "{}", said(&answer, &expected));
                if held_by(t) {
                    record = Record::Absent;
                }
            }
            Operation::Renew(t) => {
                let answer = store.touch(&key, &tokens[t], lease).await;
                let expected = if held_by(t) { Fenced::Applied } else { Fenced::Rejected };
                assert!(matches!(answer, Ok(a) if a == expected), "{}", said(&answer, &expected));
                if held_by(t) {
                    record = Record::Held { owner: t, live: true };
                }
            }
            Operation::Lapse => {
                let Record::Held { owner, .. } = record else { continue };
                let ended = Lease::new(std::time::Duration::ZERO).recovery_window(LONG);
                let answer = store.touch(&key, &tokens[owner], ended).await;
                let expected = Fenced::Applied;
                assert!(matches!(answer, Ok(a) if a == expected), "{}", said(&answer, &expected));
                record = Record::Held { owner, live: false };
            }
            Operation::Abandon(t) => {
                // Only the caller's own claim (an abandon of an absent key leaves a marker for
                // a claim still on the wire, which a sequence of landed claims never meets).
                if !held_by(t) {
                    continue;
                }
                let answer = store.abandon(&key, &tokens[t], &request, lease).await;
                let expected = Fenced::Applied;
                assert!(matches!(answer, Ok(a) if a == expected), "{}", said(&answer, &expected));
                record = Record::Held { owner: t, live: false };
            }
        }
    }
}
