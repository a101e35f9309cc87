//! Answers after the draw from memory, while the room has not moved.
//!
//! Once the draw is committed, what a poll answers a user still in line (their
//! place, the users ahead) or a user told `sold_out` changes only when the
//! room moves, and only three things move it:
//!
//! - an admission step admits users (`admit.lua`): the room's `admitted` total
//!   grows, and everyone behind them moves up;
//! - a step closes the room (no unit can come back: `sold_out`) or reopens it
//!   (units came back);
//! - the room is rebuilt after Redis lost it: another generation (`gen`).
//!
//! (A late join goes to the back of the line: no one's place ahead of it
//! changes. A settled or expired turn is an admitted user's, never a waiting
//! one's; it frees a unit, and the step that hands it on admits someone.)
//!
//! (And a user who holds a reservation and is still in line leaves it when
//! their turn is settled, `settle.lua`, counted as `left`.)
//!
//! These make the room's *mark*, `gen|admitted|left|closed`. `status.lua`
//! answers it with the place, in the same atomic call; every instance runs the
//! admission step on every room every `tick_ms` and learns the mark from the
//! step's own reply. A poll whose last answer from Redis was given under the
//! mark this instance's last step saw is answered from memory, while that step
//! is at most [`FRESH`] old: once the room moves, this instance's next step
//! sees it and the next poll asks Redis. An answer from memory is therefore at
//! most one step (a tick and the step's round trip) behind Redis, and only in
//! a room that nothing moved since the user's last answer: the line that does
//! not move (every unit held by a turn, pending or awaiting payment) and the
//! repeated `sold_out` cost no Redis call. A step that fails, waits (the sale
//! paused or being rebuilt) or stops (a minute past the end) leaves the mark
//! to go stale, and Redis answers again.
//!
//! Bounded by `waiting_room.remembered_joins` answers across rooms; a room's
//! answers are forgotten from its end on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Place;

/// How old the mark of this instance's last step may be for memory to answer:
/// a little more than the step's own pace.
pub fn fresh(tick: Duration) -> Duration {
    tick * 2 + Duration::from_millis(50)
}

/// A room's mark: what moves a waiting user's answer (see the module).
pub fn mark(gen: &str, admitted: i64, left: i64, closed: bool) -> String {
    format!("{gen}|{admitted}|{left}|{}", u8::from(closed))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Room {
    /// The mark this instance's last step saw, and when.
    seen: Option<(String, Instant)>,
    /// Users' last answers from Redis, with the mark they were given under.
    answers: HashMap<Box<str>, (String, Place)>,
}

pub struct Unmoved {
    cap: usize,
    fresh: Duration,
    len: AtomicUsize,
    rooms: Mutex<HashMap<Box<str>, Room>>,
}

impl Unmoved {
    pub fn new(cap: usize, tick: Duration) -> Self {
        Unmoved {
            cap,
            fresh: fresh(tick),
            len: AtomicUsize::new(0),
            rooms: Mutex::default(),
        }
    }

    /// Answers held, across rooms.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// The step saw the room's mark at `at`.
    pub fn saw(&self, activity_id: &str, mark: String, at: Instant) {
        if self.cap == 0 {
            return;
        }
        lock(&self.rooms)
            .entry(activity_id.into())
            .or_default()
            .seen = Some((mark, at));
    }

    /// `user`'s answer, when it cannot have moved since Redis gave it.
    pub fn known(&self, activity_id: &str, user: &str, now: Instant) -> Option<Place> {
        let rooms = lock(&self.rooms);
        let room = rooms.get(activity_id)?;
        let (seen, at) = room.seen.as_ref()?;
        if now.saturating_duration_since(*at) > self.fresh {
            return None;
        }
        let (mark, place) = room.answers.get(user)?;
        (mark == seen).then(|| place.clone())
    }

    /// Keeps Redis's answer to `user`, given under `mark`, when it is one
    /// that only the room's moving changes.
    pub fn learn(&self, activity_id: &str, user: &str, mark: String, place: &Place) {
        let keep = matches!(
            place,
            Place::Waiting { ahead: Some(_), .. } | Place::SoldOut { .. }
        );
        let mut rooms = lock(&self.rooms);
        if !keep {
            if let Some(room) = rooms.get_mut(activity_id) {
                if room.answers.remove(user).is_some() {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                }
            }
            return;
        }
        let Some(room) = rooms.get_mut(activity_id) else {
            // No step has seen this room yet: nothing to compare with.
            return;
        };
        if !room.answers.contains_key(user) && self.len() >= self.cap {
            return;
        }
        if room
            .answers
            .insert(user.into(), (mark, place.clone()))
            .is_none()
        {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a room (its sale has ended).
    pub fn forget(&self, activity_id: &str) {
        if let Some(room) = lock(&self.rooms).remove(activity_id) {
            self.len.fetch_sub(room.answers.len(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(100);

    fn waiting(ahead: u64) -> Place {
        Place::Waiting {
            ticket: "t".into(),
            ahead: Some(ahead),
        }
    }

    #[test]
    fn an_answer_holds_while_the_room_has_not_moved() {
        let m = Unmoved::new(10, TICK);
        let t = Instant::now();
        m.saw("a", mark("g", 3, 0, false), t);
        m.learn("a", "u", mark("g", 3, 0, false), &waiting(4));
        assert_eq!(m.known("a", "u", t), Some(waiting(4)));
        // The room moved: the next step sees it, and Redis answers again.
        m.saw("a", mark("g", 4, 0, false), t);
        assert_eq!(m.known("a", "u", t), None);
        // An answer given under a mark the last step has not seen yet waits
        // for the step to see it.
        m.learn("a", "u", mark("g", 5, 0, false), &waiting(2));
        assert_eq!(m.known("a", "u", t), None);
        m.saw("a", mark("g", 5, 0, false), t);
        assert_eq!(m.known("a", "u", t), Some(waiting(2)));
        // Closed, or rebuilt under another generation: moved.
        m.saw("a", mark("g", 5, 0, true), t);
        assert_eq!(m.known("a", "u", t), None);
        m.saw("a", mark("h", 5, 0, false), t);
        assert_eq!(m.known("a", "u", t), None);
    }

    #[test]
    fn a_step_that_stops_lets_redis_answer_again() {
        let m = Unmoved::new(10, TICK);
        let t = Instant::now();
        m.saw("a", mark("g", 0, 0, true), t);
        let sold_out = Place::SoldOut { ticket: "t".into() };
        m.learn("a", "u", mark("g", 0, 0, true), &sold_out);
        assert_eq!(m.known("a", "u", t + fresh(TICK)), Some(sold_out));
        assert_eq!(
            m.known("a", "u", t + fresh(TICK) + Duration::from_millis(1)),
            None
        );
    }

    #[test]
    fn only_answers_the_room_alone_moves_are_kept() {
        let m = Unmoved::new(10, TICK);
        let t = Instant::now();
        m.saw("a", mark("g", 1, 0, false), t);
        let ticket = "t".to_owned();
        for place in [
            Place::Waiting {
                ticket: ticket.clone(),
                ahead: None,
            },
            Place::Admitted {
                ticket: ticket.clone(),
                until: None,
            },
            Place::Expired {
                ticket: ticket.clone(),
            },
            Place::None,
        ] {
            m.learn("a", "u", mark("g", 1, 0, false), &place);
            assert_eq!(m.known("a", "u", t), None, "{place:?}");
        }
        // A user admitted since their last answer loses the old one.
        m.learn("a", "u", mark("g", 1, 0, false), &waiting(0));
        assert_eq!(m.len(), 1);
        m.learn(
            "a",
            "u",
            mark("g", 1, 0, false),
            &Place::Admitted {
                ticket,
                until: None,
            },
        );
        assert_eq!(m.len(), 0);
        assert_eq!(m.known("a", "u", t), None);
    }

    #[test]
    fn memory_is_bounded_and_forgotten_with_the_room() {
        let m = Unmoved::new(2, TICK);
        let t = Instant::now();
        // Not learnt before a step has seen the room.
        m.learn("a", "u0", mark("g", 0, 0, false), &waiting(0));
        assert_eq!(m.len(), 0);
        m.saw("a", mark("g", 0, 0, false), t);
        for u in ["u1", "u2", "u3"] {
            m.learn("a", u, mark("g", 0, 0, false), &waiting(1));
        }
        assert_eq!(m.len(), 2);
        assert_eq!(m.known("a", "u3", t), None);
        m.forget("a");
        assert_eq!(m.len(), 0);
        assert_eq!(m.known("a", "u1", t), None);
        let off = Unmoved::new(0, TICK);
        off.saw("a", mark("g", 0, 0, false), t);
        off.learn("a", "u", mark("g", 0, 0, false), &waiting(0));
        assert_eq!(off.known("a", "u", t), None);
    }
}
