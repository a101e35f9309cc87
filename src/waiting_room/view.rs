//! Polls answered from memory when their answer cannot have changed.
//!
//! Each instance keeps, per room it is asked about:
//! - a **view** of the room's few counters, read in one `HMGET` every
//!   [`VIEW_EVERY`]: its generation in Redis (a room rebuilt after a loss has
//!   another), whether the draw has begun, whether the room is closed, the
//!   turns given so far (each one took the first user off the line) and how
//!   often a place moved otherwise (a user settled while in line);
//! - per user, in a bounded cache ([`PLACE_CACHE_USERS`], oldest half dropped
//!   when full; a miss costs one Redis call), only what does not change while
//!   those counters do not: their ticket and, once placed, how many turns must
//!   be given before theirs (`turn_at`, the turns given plus the users ahead
//!   when Redis last answered).
//!
//! A user is answered from memory only while they are certainly still in line:
//! same generation, no place moved, fewer turns given than `turn_at`. Then
//! `ahead` is `turn_at − turns given`, exactly what `ZRANK` answered at the
//! moment the view was read: turns are given from the front of the line, a draw
//! writes places behind those already written and late joiners queue behind
//! everyone, so nothing else changes the users ahead. The answer is `sold_out`
//! when the view says closed, `waiting` otherwise. Everything else (admitted,
//! expired, settled, a view older than [`VIEW_MAX_AGE`], another generation)
//! goes to Redis, as before.
//!
//! **Staleness allowed**: an answer from memory is the answer Redis would
//! have given when the view was read, at most [`VIEW_MAX_AGE`] before. So a
//! user just admitted may hear `waiting` (ahead 0) for that long, and one whose
//! room just closed may hear `waiting`; both learn it at their next poll, well
//! within a turn. Memory never answers `admitted`: only Redis does, and the
//! reserve path asks Redis (`turn.lua`) whatever a poll said. Memory answers
//! `sold_out` only from a view read while the room was closed; a reopened room
//! admits nobody for `REOPEN_HOLD` (longer than [`VIEW_MAX_AGE`], by Redis's
//! clock), so no one is told `sold_out` from memory once admitted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Place;

/// How often an instance reads each polled room's counters.
pub const VIEW_EVERY: Duration = Duration::from_millis(20);
/// A view older than this (from the moment it was asked for) answers nothing.
pub const VIEW_MAX_AGE: Duration = Duration::from_millis(60);
/// Users whose place one instance keeps per room (both halves together).
pub const PLACE_CACHE_USERS: usize = 200_000;
const SHARDS: usize = 16;

/// The room's counters, as one `HMGET` read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct View {
    pub gen: u64,
    pub drawn: bool,
    pub closed: bool,
    pub given: u64,
    pub moved: u64,
}

impl View {
    /// `HMGET meta gen seed closed admitted moved`; `None` for a room Redis does
    /// not hold (nothing is answered from memory then).
    pub fn decode(fields: [Option<String>; 5]) -> Option<View> {
        let [gen, seed, closed, given, moved] = fields;
        let num = |v: Option<String>| v.and_then(|v| v.parse().ok()).unwrap_or(0);
        Some(View {
            gen: gen_id(&gen?),
            drawn: seed.is_some(),
            closed: closed.is_some(),
            given: num(given),
            moved: num(moved),
        })
    }
}

/// What an instance keeps of one user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    gen: u64,
    moved: u64,
    seq: u64,
    /// Turns given before this user's: turns given plus users ahead.
    turn_at: Option<u64>,
}

/// What memory answers: the user's arrival number and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    Waiting { seq: u64, ahead: Option<u64> },
    SoldOut { seq: u64 },
}

impl Answer {
    pub fn place(self, ticket: impl Fn(u64) -> String) -> Place {
        match self {
            Answer::Waiting { seq, ahead } => Place::Waiting {
                ticket: ticket(seq),
                ahead,
            },
            Answer::SoldOut { seq } => Place::SoldOut {
                ticket: ticket(seq),
            },
        }
    }
}

/// The generation's text as a number (it only has to differ between
/// generations).
fn gen_id(gen: &str) -> u64 {
    gen.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The decision, on its own: what memory may answer for `known` under `view`.
fn answer(view: &View, known: &Known) -> Option<Answer> {
    if view.gen != known.gen || view.moved != known.moved {
        return None;
    }
    match known.turn_at {
        // Not placed yet: before the draw, waiting without a place.
        None if !view.drawn => Some(Answer::Waiting {
            seq: known.seq,
            ahead: None,
        }),
        None => None,
        // Still in line: nobody took their turn yet.
        Some(at) if view.given <= at => Some(if view.closed {
            Answer::SoldOut { seq: known.seq }
        } else {
            Answer::Waiting {
                seq: known.seq,
                ahead: Some(at - view.given),
            }
        }),
        Some(_) => None,
    }
}

/// One room's memory on one instance.
struct RoomMemory {
    view: Mutex<Option<(Instant, View)>>,
    shards: Vec<Mutex<Halves>>,
}

/// A bounded map: when the newer half is full it becomes the older one and the
/// older one is dropped; a hit in the older half moves to the newer.
#[derive(Default)]
struct Halves {
    new: HashMap<String, Known>,
    old: HashMap<String, Known>,
}

impl RoomMemory {
    fn new() -> Self {
        RoomMemory {
            view: Mutex::new(None),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    fn shard(&self, user: &str) -> std::sync::MutexGuard<'_, Halves> {
        let i = (gen_id(user) % SHARDS as u64) as usize;
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, user: &str) -> Option<Known> {
        let mut s = self.shard(user);
        if let Some(k) = s.new.get(user) {
            return Some(*k);
        }
        let k = s.old.remove(user)?;
        Self::put_in(&mut s, user.to_owned(), k);
        Some(k)
    }

    fn put(&self, user: &str, known: Option<Known>) {
        let mut s = self.shard(user);
        match known {
            Some(k) => Self::put_in(&mut s, user.to_owned(), k),
            None => {
                s.new.remove(user);
                s.old.remove(user);
            }
        }
    }

    fn put_in(s: &mut Halves, user: String, k: Known) {
        let half = PLACE_CACHE_USERS / 2 / SHARDS;
        if s.new.len() >= half && !s.new.contains_key(&user) {
            s.old = std::mem::take(&mut s.new);
        }
        s.new.insert(user, k);
    }

    fn users(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.new.len() + s.old.len()
            })
            .sum()
    }
}

/// Every polled room's memory on this instance, and how polls were answered.
#[derive(Default)]
pub struct Views {
    rooms: Mutex<HashMap<String, Arc<RoomMemory>>>,
    from_memory: AtomicU64,
    from_redis: AtomicU64,
}

impl Views {
    fn room(&self, id: &str) -> Arc<RoomMemory> {
        self.rooms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.to_owned())
            .or_insert_with(|| Arc::new(RoomMemory::new()))
            .clone()
    }

    /// The answer for `user` from memory, when it cannot have changed.
    pub(super) fn answer(&self, id: &str, user: &str) -> Option<Answer> {
        let room = self.room(id);
        let view = {
            let v = room.view.lock().unwrap_or_else(|e| e.into_inner());
            match &*v {
                Some((read_at, view)) if read_at.elapsed() < VIEW_MAX_AGE => view.clone(),
                _ => return None,
            }
        };
        let answer = answer(&view, &room.get(user)?)?;
        self.from_memory.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("flashsale_waiting_room_polls_total", "answered" => "memory")
            .increment(1);
        Some(answer)
    }

    /// Keeps what Redis answered for `user` (`place.lua`'s reply).
    pub(super) fn learn(&self, id: &str, user: &str, reply: &super::PlaceReply) {
        let (state, seq, ahead, _, gen, given, moved) = reply;
        let known = match (state.as_str(), seq.parse::<u64>()) {
            ("waiting", Ok(seq)) if !gen.is_empty() => Some(Known {
                gen: gen_id(gen),
                moved: u64::try_from(*moved).unwrap_or(0),
                seq,
                turn_at: u64::try_from(*ahead)
                    .ok()
                    .map(|a| a + u64::try_from(*given).unwrap_or(0)),
            }),
            _ => None,
        };
        self.room(id).put(user, known);
    }

    /// A poll memory could not answer.
    pub(super) fn count_redis(&self) {
        self.from_redis.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("flashsale_waiting_room_polls_total", "answered" => "redis").increment(1);
    }

    /// The rooms to read views for: those polled here.
    pub(super) fn polled(&self) -> Vec<String> {
        self.rooms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// A view read now (`asked` is when it was asked for); `None` forgets it.
    pub(super) fn set_view(&self, id: &str, asked: Instant, view: Option<View>) {
        let room = self.room(id);
        *room.view.lock().unwrap_or_else(|e| e.into_inner()) = view.map(|v| (asked, v));
    }

    /// Forgets a room (its sale is over).
    pub(super) fn forget(&self, id: &str) {
        self.rooms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Polls answered from memory and from Redis since start.
    pub fn polls(&self) -> (u64, u64) {
        (
            self.from_memory.load(Ordering::Relaxed),
            self.from_redis.load(Ordering::Relaxed),
        )
    }

    /// Users whose place this instance keeps for room `id`.
    pub fn users_kept(&self, id: &str) -> usize {
        self.room(id).users()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(given: u64, closed: bool) -> View {
        View {
            gen: 7,
            drawn: true,
            closed,
            given,
            moved: 0,
        }
    }

    #[test]
    fn memory_answers_only_while_the_user_is_surely_in_line() {
        let k = Known {
            gen: 7,
            moved: 0,
            seq: 42,
            turn_at: Some(10),
        };
        assert_eq!(
            answer(&view(4, false), &k),
            Some(Answer::Waiting {
                seq: 42,
                ahead: Some(6)
            })
        );
        assert_eq!(
            answer(&view(10, false), &k),
            Some(Answer::Waiting {
                seq: 42,
                ahead: Some(0)
            })
        );
        // Their turn was given: only Redis knows what became of it.
        assert_eq!(answer(&view(11, false), &k), None);
        assert_eq!(
            answer(&view(4, true), &k),
            Some(Answer::SoldOut { seq: 42 })
        );
        // Another generation, a place moved: Redis.
        assert_eq!(
            answer(
                &View {
                    gen: 8,
                    ..view(4, false)
                },
                &k
            ),
            None
        );
        assert_eq!(
            answer(
                &View {
                    moved: 1,
                    ..view(4, false)
                },
                &k
            ),
            None
        );
        // Not placed: waiting before the draw, Redis once it began.
        let unplaced = Known { turn_at: None, ..k };
        assert_eq!(
            answer(
                &View {
                    drawn: false,
                    ..view(0, false)
                },
                &unplaced
            ),
            Some(Answer::Waiting {
                seq: 42,
                ahead: None
            })
        );
        assert_eq!(answer(&view(0, false), &unplaced), None);
    }

    #[test]
    fn the_cache_stays_bounded() {
        let room = RoomMemory::new();
        let k = Known {
            gen: 1,
            moved: 0,
            seq: 1,
            turn_at: None,
        };
        for i in 0..(PLACE_CACHE_USERS * 2) {
            room.put(&format!("u{i}"), Some(k));
        }
        assert!(room.users() <= PLACE_CACHE_USERS, "{}", room.users());
        // The most recent are kept; a miss is only a Redis call.
        assert!(room
            .get(&format!("u{}", PLACE_CACHE_USERS * 2 - 1))
            .is_some());
        assert!(room.get("u0").is_none());
    }
}
