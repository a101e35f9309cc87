//! Answers after the draw from memory, while the room has not moved.
//!
//! Once the draw is committed, what a poll answers a user still in line (their
//! place, the users ahead) or a user told `sold_out` changes only when the
//! room moves, and only these move it:
//!
//! - an admission step admits users (`admit.lua`): the room's `admitted` total
//!   grows, and everyone behind them moves up;
//! - a user who holds a reservation and is still in line leaves it when their
//!   turn is settled (`settle.lua`): the `left` total grows;
//! - a step closes the room (no unit can come back: `sold_out`) or reopens it
//!   (units came back);
//! - the room is lost and rebuilt: another generation (`gen`), or none.
//!
//! (A late join goes to the back of the line: no one's place ahead of it
//! changes. A turn settled or run out is an admitted user's, not a waiting
//! one's; the unit it frees is handed on by a step that admits someone.)
//!
//! These make the room's *mark*: generation, admitted, left, closed.
//! `status.lua` answers it with the place, in the same atomic call; every
//! instance runs the admission step on every room every `tick_ms` and learns
//! the mark from the step's own reply. A poll whose last answer from Redis was
//! given under the mark this instance's last step saw is answered from memory,
//! while that step is at most [`fresh`] old: once the room moves, this
//! instance's next step sees it and the next poll asks Redis. An answer from
//! memory is so at most one step (a tick and the step's round trip) behind
//! Redis, and only in a room nothing moved since the user's last answer: the
//! line that does not move (every unit held by a turn, pending or awaiting
//! payment) and the repeated `sold_out` cost no Redis call. A step that fails,
//! waits (the sale paused or being rebuilt) or stops (a minute past the end)
//! leaves the mark to go stale, and Redis answers again.
//!
//! A step that finds the mark moved drops every answer the room held (none
//! can be given again), so memory holds a room's answers only while its line
//! stands still. So does a step answered by another Redis process than the
//! last (its `run_id`): a failover to a replica that missed the last writes,
//! or a restart, can bring the same mark back over another line (a late join
//! lost; a settle lost and another made). A room Redis holds no drawn state
//! of (lost, or not drawn yet) is forgotten at once.
//!
//! Instances learn independently, so within that window two instances may
//! answer one user differently (one has seen an admission, the other's next
//! step has not yet): a position never goes against the draw's order, but a
//! user may read `admitted` from one instance and, for a step's time,
//! `waiting` from another.
//!
//! Bounded by `waiting_room.remembered_joins` answers across rooms (apart from
//! the joins remembered before the start, [`super::early`]); a room's answers
//! are forgotten from its end on, and a room no step saw for ten minutes when
//! another room comes.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use super::Place;

/// How old the mark of this instance's last step may be for memory to answer:
/// a little more than the step's own pace.
pub fn fresh(tick: Duration) -> Duration {
    tick * 2 + Duration::from_millis(50)
}

/// A room no step has seen for this long is dropped (a step runs every tick
/// until a minute past the sale's end).
const STALE_ROOM: Duration = Duration::from_secs(600);
/// Locks per room: polls of one room spread over them.
const SHARDS: usize = 64;

/// What moves a waiting user's answer (see the module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    gen: Arc<str>,
    admitted: i64,
    left: i64,
    closed: bool,
}

impl Mark {
    pub fn new(gen: &str, admitted: i64, left: i64, closed: bool) -> Self {
        Mark {
            gen: gen.into(),
            admitted,
            left,
            closed,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The mark this instance's last step saw: when, and from which Redis process.
struct Seen {
    mark: Mark,
    run_id: Box<str>,
    at: Instant,
}

/// Users' last answers from Redis, with the mark they were given under.
type Answers = HashMap<Box<str>, (Mark, Place)>;

struct Room {
    seen: RwLock<Option<Seen>>,
    parts: Vec<Mutex<Answers>>,
    /// Answers held: counted per room, so a room dropped while a poll was
    /// learning into it takes its count with it.
    held: AtomicUsize,
}

impl Room {
    fn new() -> Self {
        Room {
            seen: RwLock::new(None),
            parts: (0..SHARDS).map(|_| Mutex::default()).collect(),
            held: AtomicUsize::new(0),
        }
    }

    /// Drops every answer.
    fn clear(&self) {
        for p in &self.parts {
            let mut p = lock(p);
            self.held.fetch_sub(p.len(), Ordering::Relaxed);
            p.clear();
        }
    }
}

pub struct Unmoved {
    cap: usize,
    fresh: Duration,
    hasher: RandomState,
    rooms: RwLock<HashMap<Box<str>, Arc<Room>>>,
}

impl Unmoved {
    pub fn new(cap: usize, tick: Duration) -> Self {
        Unmoved {
            cap,
            fresh: fresh(tick),
            hasher: RandomState::new(),
            rooms: RwLock::default(),
        }
    }

    /// Answers held, across rooms.
    pub fn len(&self) -> usize {
        self.rooms
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|r| r.held.load(Ordering::Relaxed))
            .sum()
    }

    fn room(&self, activity_id: &str) -> Option<Arc<Room>> {
        self.rooms
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(activity_id)
            .cloned()
    }

    fn part<'a>(&self, room: &'a Room, user: &str) -> &'a Mutex<Answers> {
        &room.parts[(self.hasher.hash_one(user) as usize) % SHARDS]
    }

    /// The step saw the room's mark at `at`, answered by the Redis process
    /// `run_id`. A mark that moved, or another process (a failover or a
    /// restart may have lost the last writes, and bring a mark back with
    /// another line), drops every answer the room held: none can be given
    /// again.
    pub fn saw(&self, activity_id: &str, mark: Mark, run_id: &str, at: Instant) {
        if self.cap == 0 {
            return;
        }
        let room = match self.room(activity_id) {
            Some(room) => room,
            None => {
                let mut rooms = self.rooms.write().unwrap_or_else(|e| e.into_inner());
                rooms.retain(|_, r| {
                    r.seen
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                        .is_some_and(|s| at.saturating_duration_since(s.at) <= STALE_ROOM)
                });
                rooms
                    .entry(activity_id.into())
                    .or_insert_with(|| Arc::new(Room::new()))
                    .clone()
            }
        };
        let moved = {
            let mut seen = room.seen.write().unwrap_or_else(|e| e.into_inner());
            let moved = seen
                .as_ref()
                .is_some_and(|s| s.mark != mark || *s.run_id != *run_id);
            *seen = Some(Seen {
                mark,
                run_id: run_id.into(),
                at,
            });
            moved
        };
        if moved {
            room.clear();
        }
    }

    /// `user`'s answer, when it cannot have moved since Redis gave it.
    pub fn known(&self, activity_id: &str, user: &str, now: Instant) -> Option<Place> {
        let room = self.room(activity_id)?;
        let seen = room.seen.read().unwrap_or_else(|e| e.into_inner());
        let seen = seen.as_ref()?;
        if now.saturating_duration_since(seen.at) > self.fresh {
            return None;
        }
        let part = lock(self.part(&room, user));
        let (mark, place) = part.get(user)?;
        (*mark == seen.mark).then(|| place.clone())
    }

    /// Keeps Redis's answer to `user`, given under `mark`, when it is one
    /// that only the room's moving changes.
    pub fn learn(&self, activity_id: &str, user: &str, mark: Mark, place: &Place) {
        if self.cap == 0 {
            return;
        }
        // No step has seen this room yet: nothing to compare with.
        let Some(room) = self.room(activity_id) else {
            return;
        };
        let keep = matches!(
            place,
            Place::Waiting { ahead: Some(_), .. } | Place::SoldOut { .. }
        );
        if keep && self.len() >= self.cap {
            let mut part = lock(self.part(&room, user));
            if let Some(held) = part.get_mut(user) {
                *held = (mark, place.clone());
            }
            return;
        }
        let mut part = lock(self.part(&room, user));
        if !keep {
            if part.remove(user).is_some() {
                room.held.fetch_sub(1, Ordering::Relaxed);
            }
            return;
        }
        if part.insert(user.into(), (mark, place.clone())).is_none() {
            room.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a room (its sale has ended, or Redis holds no drawn room).
    pub fn forget(&self, activity_id: &str) {
        let room = self
            .rooms
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(activity_id);
        if let Some(room) = room {
            room.clear();
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

    fn m(admitted: i64) -> Mark {
        Mark::new("g", admitted, 0, false)
    }

    #[test]
    fn an_answer_holds_while_the_room_has_not_moved() {
        let u = Unmoved::new(10, TICK);
        let t = Instant::now();
        u.saw("a", m(3), "r", t);
        u.learn("a", "u", m(3), &waiting(4));
        assert_eq!(u.known("a", "u", t), Some(waiting(4)));
        // Another step, nothing moved: still answered.
        u.saw("a", m(3), "r", t);
        assert_eq!(u.known("a", "u", t), Some(waiting(4)));
        // The room moved: the next step sees it, and Redis answers again.
        u.saw("a", m(4), "r", t);
        assert_eq!(u.known("a", "u", t), None);
        assert_eq!(u.len(), 0, "a move drops every answer");
        // An answer given under a mark the last step has not seen is never
        // given from memory: the step that sees it drops it.
        u.learn("a", "u", m(5), &waiting(2));
        assert_eq!(u.known("a", "u", t), None);
        u.saw("a", m(5), "r", t);
        assert_eq!(u.known("a", "u", t), None);
        u.learn("a", "u", m(5), &waiting(2));
        assert_eq!(u.known("a", "u", t), Some(waiting(2)));
        // Closed, or rebuilt under another generation: moved.
        u.saw("a", Mark::new("g", 5, 0, true), "r", t);
        assert_eq!(u.known("a", "u", t), None);
        u.saw("a", Mark::new("h", 5, 0, true), "r", t);
        assert_eq!(u.known("a", "u", t), None);
    }

    #[test]
    fn another_redis_process_drops_the_room_even_under_the_same_mark() {
        let u = Unmoved::new(10, TICK);
        let t = Instant::now();
        u.saw("a", m(3), "r1", t);
        u.learn("a", "u", m(3), &waiting(4));
        // A failover to a replica that missed the last writes can bring the
        // same mark back over another line.
        u.saw("a", m(3), "r2", t);
        assert_eq!(u.known("a", "u", t), None);
        assert_eq!(u.len(), 0);
    }

    #[test]
    fn a_step_that_stops_lets_redis_answer_again() {
        let u = Unmoved::new(10, TICK);
        let t = Instant::now();
        let closed = Mark::new("g", 0, 0, true);
        u.saw("a", closed.clone(), "r", t);
        let sold_out = Place::SoldOut { ticket: "t".into() };
        u.learn("a", "u", closed, &sold_out);
        assert_eq!(u.known("a", "u", t + fresh(TICK)), Some(sold_out));
        assert_eq!(
            u.known("a", "u", t + fresh(TICK) + Duration::from_millis(1)),
            None
        );
    }

    #[test]
    fn only_answers_the_room_alone_moves_are_kept() {
        let u = Unmoved::new(10, TICK);
        let t = Instant::now();
        u.saw("a", m(1), "r", t);
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
            u.learn("a", "u", m(1), &place);
            assert_eq!(u.known("a", "u", t), None, "{place:?}");
        }
        // A user admitted since their last answer loses the old one.
        u.learn("a", "u", m(1), &waiting(0));
        assert_eq!(u.len(), 1);
        u.learn(
            "a",
            "u",
            m(1),
            &Place::Admitted {
                ticket,
                until: None,
            },
        );
        assert_eq!(u.len(), 0);
        assert_eq!(u.known("a", "u", t), None);
    }

    #[test]
    fn memory_is_bounded_and_forgotten_with_the_room() {
        let u = Unmoved::new(2, TICK);
        let t = Instant::now();
        // Not learnt before a step has seen the room.
        u.learn("a", "u0", m(0), &waiting(0));
        assert_eq!(u.len(), 0);
        u.saw("a", m(0), "r", t);
        for user in ["u1", "u2", "u3"] {
            u.learn("a", user, m(0), &waiting(1));
        }
        assert_eq!(u.len(), 2);
        assert_eq!(u.known("a", "u3", t), None);
        // An answer held is replaced, not counted twice.
        u.learn("a", "u1", m(0), &waiting(1));
        assert_eq!(u.len(), 2);
        u.forget("a");
        assert_eq!(u.len(), 0);
        assert_eq!(u.known("a", "u1", t), None);
        // A room no step has seen for long goes when another room comes.
        u.saw("b", m(0), "r", t);
        u.learn("b", "u", m(0), &waiting(0));
        u.saw("c", m(0), "r", t + STALE_ROOM + Duration::from_secs(1));
        assert_eq!(u.len(), 0);
        assert_eq!(u.known("b", "u", t), None);
        let off = Unmoved::new(0, TICK);
        off.saw("a", m(0), "r", t);
        off.learn("a", "u", m(0), &waiting(0));
        assert_eq!(off.known("a", "u", t), None);
    }
}
