//! Answers before the start from memory: the users an instance saw join a room
//! before its start, with their arrival numbers.
//!
//! Until the draw, a joined user's answer is "waiting, this ticket, no place
//! yet": the draw, the admissions and the close all come after the start. So a
//! poll of a user this instance remembers is answered without a Redis call
//! while the start is more than [`MARGIN`] ahead. (A join always goes to Redis,
//! in one script call: a client that joins again repairs whatever Redis lost.)
//! What could still change the answer is checked once a second per room
//! ([`CHECK_EVERY`], one script call, `check.lua`) rather than per request:
//!
//! - **the room's generation** (`gen` in its meta hash, set by the join that
//!   created the room, ordered by Redis's clock): a room Redis lost whole (a
//!   restart empty, a `DEL`) and a join created again has another;
//! - **the Redis process** (its `run_id`): a failover or a restart may lose
//!   the last writes before it (a replica is behind its primary; a snapshot is
//!   older than the process it restores), so a room answered by another
//!   process than at the room's first check is forgotten, lost writes or not;
//! - **the last join learnt**: the highest arrival number this instance
//!   learnt, with its user, as it was when the check was sent: that user still
//!   holds that number and the counter is not below it (Redis applies writes
//!   in order, so a later join surviving means the earlier ones did);
//! - **Redis's clock**: the draw is sealed by Redis's clock `DRAW_GRACE` after
//!   the start; memory answers only while this instance's clock is within
//!   [`MAX_SKEW_MS`] of Redis's (bounded by the check's round trip), so the
//!   window always closes before the draw.
//!
//! A room a check finds changed is forgotten (Redis answers again: `404` for a
//! user it no longer has, who joins again). A check that fails (Redis slow or
//! down) or finds the clocks apart forgets nothing, but memory stops answering
//! until a check confirms the room again. While one request checks a room, the
//! others keep answering from memory if the last confirmation is under
//! 2 × [`CHECK_EVERY`] old, so an answer from memory is at most two seconds
//! behind Redis.
//!
//! Instances learn independently, from the joins and polls they answer. Memory
//! is bounded by `waiting_room.remembered_joins` users across rooms (about 100
//! bytes each, more while a map grows); past it, users are asked of Redis. A
//! room's users are forgotten by the first upkeep step past the window, or as
//! soon as a check disagrees.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::{Place, DRAW_GRACE};
use crate::activity::Activity;

/// How long before the start memory stops answering.
pub const MARGIN: Duration = DRAW_GRACE;
/// How long a room's check holds.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// The largest difference between this instance's clock and Redis's at which
/// memory answers (the check's round trip counted against it): with
/// [`MARGIN`], the window closes at least half a second before the draw can be
/// sealed.
pub const MAX_SKEW_MS: i64 = 500;
/// Locks per room: joins and polls of one room spread over them, and a map
/// growing doubles one part at a time.
const SHARDS: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One room's remembered joiners, for one generation of it in Redis.
pub struct EarlyRoom {
    gen: String,
    users: Vec<Mutex<HashMap<Box<str>, u64>>>,
    hasher: std::collections::hash_map::RandomState,
    count: AtomicUsize,
    /// Users remembered across rooms: this room's count leaves it when the
    /// room is dropped (after the last request holding it let go).
    total: Arc<AtomicUsize>,
    /// The join with the highest arrival number learnt (a check asks that
    /// Redis still has it).
    last: Mutex<Option<(u64, Box<str>)>>,
    /// The Redis process (`run_id`) that answered the room's first check.
    node: Mutex<Option<String>>,
    /// When the last check that confirmed the room was sent.
    checked: Mutex<Option<Instant>>,
    checking: AtomicBool,
}

impl Drop for EarlyRoom {
    fn drop(&mut self) {
        self.total
            .fetch_sub(self.count.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl EarlyRoom {
    fn new(gen: &str, total: Arc<AtomicUsize>) -> Self {
        EarlyRoom {
            gen: gen.to_owned(),
            users: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: Default::default(),
            count: AtomicUsize::new(0),
            total,
            last: Mutex::default(),
            node: Mutex::default(),
            checked: Mutex::new(None),
            checking: AtomicBool::new(false),
        }
    }

    pub fn gen(&self) -> &str {
        &self.gen
    }

    /// The join with the highest arrival number learnt so far: what a check
    /// sent now asks Redis about.
    pub fn last(&self) -> Option<(u64, Box<str>)> {
        lock(&self.last).clone()
    }

    fn shard(&self, user: &str) -> &Mutex<HashMap<Box<str>, u64>> {
        &self.users[(self.hasher.hash_one(user) as usize) % SHARDS]
    }

    fn seq(&self, user: &str) -> Option<u64> {
        lock(self.shard(user)).get(user).copied()
    }

    /// How long ago the last confirming check was sent, if one was.
    fn age(&self) -> Option<Duration> {
        lock(&self.checked).map(|at| at.elapsed())
    }

    /// The right to check this room now, unless another request is checking
    /// it.
    pub fn begin_check(self: &Arc<Self>) -> Option<CheckGuard> {
        (!self.checking.swap(true, Ordering::AcqRel)).then(|| CheckGuard(self.clone()))
    }
}

/// Held while a room is being checked; lets the next check run when dropped,
/// even if the request checking was cancelled.
pub struct CheckGuard(Arc<EarlyRoom>);

impl CheckGuard {
    /// Redis confirmed the room, in a check sent at `sent`.
    pub fn confirmed(self, sent: Instant) {
        *lock(&self.0.checked) = Some(sent);
    }

    /// Redis could not confirm the room: memory stops answering until a
    /// check does.
    pub fn distrust(self) {
        *lock(&self.0.checked) = None;
    }
}

impl Drop for CheckGuard {
    fn drop(&mut self) {
        self.0.checking.store(false, Ordering::Release);
    }
}

/// What memory knows of a user.
pub enum Known {
    /// Memory answers: the room was checked within [`CHECK_EVERY`], or within
    /// twice that while another request checks it.
    Answer(Place),
    /// Memory would answer once the room is checked.
    Unchecked(Arc<EarlyRoom>, u64),
}

/// What a check's reply says of a room.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The same room, nothing lost, the clocks together.
    Confirmed,
    /// Another room, or one that lost writes: forget what was remembered.
    Lost,
    /// The clocks too far apart (or the round trip too long to tell): Redis
    /// answers, memory is kept.
    Unsure,
}

/// What `check.lua` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReply {
    /// The room's generation ("" when it has none).
    pub gen: String,
    /// The room's arrival counter.
    pub counter: u64,
    /// Whether the last join learnt is still there, with its number.
    pub last_kept: bool,
    /// The Redis process that ran the check.
    pub run_id: String,
    /// Redis's clock, ms.
    pub redis_ms: i64,
}

/// A check's `reply`, for a check sent with `last` (the join with the highest
/// number learnt then), Redis's clock read between `before_ms` and `after_ms`
/// of ours.
pub fn verdict(
    room: &EarlyRoom,
    last: Option<u64>,
    reply: &CheckReply,
    before_ms: i64,
    after_ms: i64,
) -> Verdict {
    let node_changed = lock(&room.node)
        .as_deref()
        .is_some_and(|node| node != reply.run_id);
    if reply.gen.is_empty()
        || reply.gen != room.gen()
        || node_changed
        || !reply.last_kept
        || last.is_some_and(|seq| reply.counter < seq)
    {
        return Verdict::Lost;
    }
    // Redis's clock was read somewhere between `before` and `after`: the
    // difference is within the bound whichever moment it was.
    if reply.redis_ms - before_ms > MAX_SKEW_MS || after_ms - reply.redis_ms > MAX_SKEW_MS {
        return Verdict::Unsure;
    }
    lock(&room.node).get_or_insert_with(|| reply.run_id.clone());
    Verdict::Confirmed
}

/// The users each room's instance saw join before its start.
pub struct EarlyJoins {
    cap: usize,
    len: Arc<AtomicUsize>,
    rooms: RwLock<HashMap<String, Arc<EarlyRoom>>>,
}

impl EarlyJoins {
    pub fn new(cap: usize) -> Self {
        EarlyJoins {
            cap,
            len: Arc::default(),
            rooms: RwLock::default(),
        }
    }

    /// Whether `now` is inside the window where memory may answer.
    pub fn before_start(a: &Activity, now: DateTime<Utc>) -> bool {
        now + chrono::Duration::from_std(MARGIN).unwrap_or_default() < a.starts_at
    }

    /// Users remembered, across rooms.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// What memory knows of `user` in `a`'s room, if anything.
    pub fn known(&self, a: &Activity, user: &str, now: DateTime<Utc>) -> Option<Known> {
        if self.cap == 0 || !Self::before_start(a, now) {
            return None;
        }
        let room = self.room(&a.id)?;
        let seq = room.seq(user)?;
        let answer = match room.age() {
            Some(age) if age < CHECK_EVERY => true,
            Some(age) if age < CHECK_EVERY * 2 => room.checking.load(Ordering::Acquire),
            _ => false,
        };
        Some(if answer {
            Known::Answer(waiting(a, seq))
        } else {
            Known::Unchecked(room, seq)
        })
    }

    fn room(&self, activity_id: &str) -> Option<Arc<EarlyRoom>> {
        self.rooms
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(activity_id)
            .cloned()
    }

    fn rooms_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<EarlyRoom>>> {
        self.rooms.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers `user` when Redis's answer is the one that holds until the
    /// start (waiting, not placed yet) in generation `gen` of the room.
    pub fn learn(
        &self,
        a: &Activity,
        user: &str,
        seq: &str,
        place: &Place,
        gen: &str,
        now: DateTime<Utc>,
    ) {
        if self.cap == 0
            || gen.is_empty()
            || !Self::before_start(a, now)
            || !matches!(place, Place::Waiting { ahead: None, .. })
        {
            return;
        }
        let Ok(seq) = seq.parse::<u64>() else {
            return;
        };
        let room = match self.room(&a.id) {
            Some(room) if room.gen == gen => room,
            // A late answer from a room Redis lost before the one remembered
            // (generations are ordered by Redis's clock).
            Some(room) if room.gen.as_str() > gen => return,
            _ => {
                let room = Arc::new(EarlyRoom::new(gen, self.len.clone()));
                let mut rooms = self.rooms_mut();
                match rooms.get(&a.id) {
                    Some(other) if other.gen == gen => other.clone(),
                    Some(other) if other.gen.as_str() > gen => return,
                    _ => {
                        let old = rooms.insert(a.id.clone(), room.clone());
                        drop(rooms);
                        dropped(old);
                        room
                    }
                }
            }
        };
        {
            let mut last = lock(&room.last);
            if last.as_ref().is_none_or(|(highest, _)| seq > *highest) {
                *last = Some((seq, user.into()));
            }
        }
        let mut users = lock(room.shard(user));
        if let Some(known) = users.get_mut(user) {
            // A user Redis lost and who joined again has a new number.
            *known = seq;
            return;
        }
        if self.len() >= self.cap {
            return;
        }
        users.insert(user.into(), seq);
        room.count.fetch_add(1, Ordering::Relaxed);
        self.len.fetch_add(1, Ordering::Relaxed);
    }

    /// Forgets a room's users (its window has closed).
    pub fn forget(&self, activity_id: &str) {
        if self.room(activity_id).is_none() {
            return;
        }
        let old = self.rooms_mut().remove(activity_id);
        dropped(old);
    }

    /// Forgets a room's users if they are still those of generation `gen` (a
    /// check disagreed).
    pub fn forget_gen(&self, activity_id: &str, gen: &str) {
        let old = {
            let mut rooms = self.rooms_mut();
            match rooms.get(activity_id) {
                Some(room) if room.gen == gen => rooms.remove(activity_id),
                _ => None,
            }
        };
        dropped(old);
    }
}

/// Frees a room off the async workers (a million users take milliseconds to
/// free); its users leave the count when the last holder lets it go.
fn dropped(room: Option<Arc<EarlyRoom>>) {
    let Some(room) = room else {
        return;
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(move || drop(room))),
        Err(_) => drop(room),
    }
}

/// The answer memory gives: waiting, the user's ticket, no place yet.
pub fn waiting(a: &Activity, seq: u64) -> Place {
    Place::Waiting {
        ticket: super::ticket(a, &seq.to_string()),
        ahead: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(starts_in: chrono::Duration) -> Activity {
        Activity::room_for_tests(Utc::now() + starts_in)
    }

    /// The remembered arrival number, checked or not.
    fn seq(early: &EarlyJoins, a: &Activity, user: &str, now: DateTime<Utc>) -> Option<u64> {
        match early.known(a, user, now)? {
            Known::Answer(Place::Waiting { ticket, .. }) => {
                ticket.rsplit('-').next().and_then(|s| s.parse().ok())
            }
            Known::Answer(_) => None,
            Known::Unchecked(_, seq) => Some(seq),
        }
    }

    #[test]
    fn early_joins_answer_only_before_the_start_and_stay_bounded() {
        let a = room(chrono::Duration::minutes(5));
        let now = Utc::now();
        let early = EarlyJoins::new(2);
        let w = |seq| waiting(&a, seq);
        // Only a not-yet-placed waiting user of a room with a generation.
        early.learn(&a, "u0", "3", &Place::None, "g1", now);
        let placed = Place::Waiting {
            ticket: super::super::ticket(&a, "4"),
            ahead: Some(0),
        };
        early.learn(&a, "u0", "4", &placed, "g1", now);
        early.learn(&a, "u0", "4", &w(4), "", now);
        assert_eq!(seq(&early, &a, "u0", now), None);
        early.learn(&a, "u1", "1", &w(1), "g1", now);
        early.learn(&a, "u1", "1", &w(1), "g1", now);
        early.learn(&a, "u2", "2", &w(2), "g1", now);
        early.learn(&a, "u3", "3", &w(3), "g1", now);
        assert_eq!(early.len(), 2);
        assert_eq!(seq(&early, &a, "u1", now), Some(1));
        assert_eq!(seq(&early, &a, "u2", now), Some(2));
        assert_eq!(seq(&early, &a, "u3", now), None, "past the bound");
        // Within a second of the start, Redis answers again.
        let late = a.starts_at - chrono::Duration::milliseconds(900);
        assert_eq!(seq(&early, &a, "u1", late), None);
        // A room of another generation replaces what was remembered.
        early.forget_gen(&a.id, "g0");
        assert_eq!(early.len(), 2, "another generation's check changes nothing");
        early.learn(&a, "u3", "3", &w(3), "g2", now);
        assert_eq!(early.len(), 1);
        assert_eq!(seq(&early, &a, "u1", now), None);
        assert_eq!(seq(&early, &a, "u3", now), Some(3));
        early.forget_gen(&a.id, "g2");
        assert_eq!(early.len(), 0);
        early.learn(&a, "u3", "3", &w(3), "g2", now);
        early.forget(&a.id);
        assert_eq!(early.len(), 0);
        assert_eq!(seq(&early, &a, "u3", now), None);
        // Off.
        let off = EarlyJoins::new(0);
        off.learn(&a, "u1", "1", &w(1), "g1", now);
        assert_eq!(seq(&off, &a, "u1", now), None);
        // A room that started is never remembered.
        let started = room(chrono::Duration::seconds(-1));
        early.learn(&started, "u9", "9", &w(9), "g1", now);
        assert_eq!(early.len(), 0);
    }

    #[test]
    fn a_room_answers_from_memory_only_once_checked() {
        let a = room(chrono::Duration::minutes(5));
        let now = Utc::now();
        let early = EarlyJoins::new(10);
        early.learn(&a, "u1", "7", &waiting(&a, 7), "g1", now);
        let Some(Known::Unchecked(r, 7)) = early.known(&a, "u1", now) else {
            panic!("unchecked at first");
        };
        let guard = r.begin_check().expect("the first check");
        assert!(r.begin_check().is_none(), "one check at a time");
        drop(guard);
        let guard = r.begin_check().expect("a dropped check lets the next run");
        guard.confirmed(Instant::now());
        assert!(matches!(
            early.known(&a, "u1", now),
            Some(Known::Answer(p)) if p == waiting(&a, 7)
        ));
        // A check a second and a half old: memory answers only while another
        // request is checking.
        let guard = r.begin_check().expect("a check");
        guard.confirmed(Instant::now() - Duration::from_millis(1_500));
        assert!(matches!(
            early.known(&a, "u1", now),
            Some(Known::Unchecked(_, 7))
        ));
        let checking = r.begin_check().expect("a check");
        assert!(matches!(early.known(&a, "u1", now), Some(Known::Answer(_))));
        drop(checking);
        // What a check's reply says.
        let t = 1_000_000;
        let reply = |gen: &str, counter, last_kept, run_id: &str, redis_ms| CheckReply {
            gen: gen.into(),
            counter,
            last_kept,
            run_id: run_id.into(),
            redis_ms,
        };
        let ok = reply("g1", 7, true, "n1", t);
        assert_eq!(verdict(&r, Some(7), &ok, t, t), Verdict::Confirmed);
        assert_eq!(
            verdict(
                &r,
                Some(7),
                &reply("g1", 9, true, "n1", t + 400),
                t - 50,
                t + 50
            ),
            Verdict::Confirmed
        );
        assert_eq!(
            verdict(&r, Some(7), &reply("g1", 6, true, "n1", t), t, t),
            Verdict::Lost,
            "the counter went back"
        );
        assert_eq!(
            verdict(&r, Some(7), &reply("g1", 9, false, "n1", t), t, t),
            Verdict::Lost,
            "the last join learnt is gone, whatever joined since"
        );
        assert_eq!(
            verdict(&r, Some(7), &reply("g1", 9, true, "n2", t), t, t),
            Verdict::Lost,
            "another Redis process than at the first check"
        );
        assert_eq!(
            verdict(&r, Some(7), &reply("g2", 7, true, "n1", t), t, t),
            Verdict::Lost
        );
        assert_eq!(
            verdict(&r, Some(7), &reply("", 7, true, "n1", t), t, t),
            Verdict::Lost
        );
        assert_eq!(
            verdict(
                &r,
                Some(7),
                &reply("g1", 7, true, "n1", t + MAX_SKEW_MS + 1),
                t,
                t
            ),
            Verdict::Unsure
        );
        assert_eq!(
            verdict(
                &r,
                Some(7),
                &reply("g1", 7, true, "n1", t),
                t - 300,
                t + 300
            ),
            Verdict::Confirmed,
            "within the bound at either end"
        );
        assert_eq!(
            verdict(
                &r,
                Some(7),
                &reply("g1", 7, true, "n1", t),
                t - 600,
                t + 600
            ),
            Verdict::Unsure,
            "a round trip too long to tell"
        );
        // A check that cannot confirm stops memory until one does.
        r.begin_check().expect("a check").distrust();
        assert!(matches!(
            early.known(&a, "u1", now),
            Some(Known::Unchecked(_, 7))
        ));
        // A late answer of an older generation leaves the newer one in place.
        early.learn(&a, "u1", "7", &waiting(&a, 7), "g0", now);
        assert!(
            matches!(early.known(&a, "u1", now), Some(Known::Unchecked(r, 7)) if r.gen() == "g1")
        );
        early.learn(&a, "u2", "1", &waiting(&a, 1), "g2", now);
        assert_eq!(
            seq(&early, &a, "u1", now),
            None,
            "a newer room replaces the older"
        );
        assert_eq!(seq(&early, &a, "u2", now), Some(1));
    }

    #[test]
    fn a_room_dropped_while_held_counts_out_once_let_go() {
        let a = room(chrono::Duration::minutes(5));
        let now = Utc::now();
        let early = EarlyJoins::new(10);
        early.learn(&a, "u1", "1", &waiting(&a, 1), "g1", now);
        let Some(Known::Unchecked(held, _)) = early.known(&a, "u1", now) else {
            panic!("remembered");
        };
        early.forget(&a.id);
        // A request that held the room learns into it after it was forgotten.
        held.count.fetch_add(1, Ordering::Relaxed);
        early.len.fetch_add(1, Ordering::Relaxed);
        assert_eq!(early.len(), 2);
        drop(held);
        assert_eq!(early.len(), 0);
        // A user Redis lost who joined again is remembered with the new number.
        early.learn(&a, "u1", "1", &waiting(&a, 1), "g1", now);
        early.learn(&a, "u1", "5", &waiting(&a, 5), "g1", now);
        assert_eq!(early.len(), 1);
        assert_eq!(seq(&early, &a, "u1", now), Some(5));
        // The last join is the highest number learnt, in whatever order.
        early.learn(&a, "u2", "9", &waiting(&a, 9), "g1", now);
        early.learn(&a, "u3", "8", &waiting(&a, 8), "g1", now);
        let Some(Known::Unchecked(r, _)) = early.known(&a, "u3", now) else {
            panic!("remembered");
        };
        assert_eq!(r.last(), Some((9, "u2".into())));
    }
}
