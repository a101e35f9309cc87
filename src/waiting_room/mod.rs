//! The waiting room (docs/API.md, version 2): a fair draw, and admissions that follow
//! the stock.
//!
//! - **Joining.** From `starts_at − waiting_room_secs` a user joins once
//!   (`join.lua`); their ticket is their arrival number.
//! - **The draw.** Just after `starts_at` (`DRAW_GRACE`, for instances whose clocks
//!   differ a little) the order of everyone who joined before the start is drawn:
//!   a Fisher–Yates shuffle of the users in arrival order driven by SplitMix64 from
//!   a random 53-bit seed ([`draw_order`]). The seed (with the joiners' count and
//!   digest) is recorded in MySQL first (`waiting_room_draws`, the first
//!   instance's insert wins); the places then go to Redis as a growing prefix,
//!   so the front of the line is admitted while the rest is written, and are
//!   recorded in MySQL (`waiting_room_entries`) in batches meanwhile (see
//!   `draw.rs`). Late joiners queue behind once every drawn place is written,
//!   in arrival order. An auditor replays the draw from the seed and the arrival
//!   order; a Redis that lost the queue gets the same places back from MySQL.
//! - **Admission follows the stock.** Every `tick_ms` each instance runs one
//!   admission step (`admit.lua`, atomic, so instances do not add up): turns that
//!   ran out are settled `expired`, then users are admitted in queue order until
//!   as many hold a turn as there are units left. A turn ends when its user
//!   reserves (`settle.lua`). While no unit can come back (none left, none
//!   pending, no order awaiting payment) the room is closed and everyone still
//!   waiting is told `sold_out`; units that come back later (a top-up, a lapse,
//!   a repair) reopen it, and the line moves on from where it stood.
//! - **The draw sees every early joiner.** It reads them in the same atomic
//!   step that seals the early joins (`seal.lua`): a join after that is late,
//!   whatever the joining instance's clock says.
//! - **Cheap to wait.** A join is one script call (`join.lua`, which answers the
//!   place too), a poll at most one (`status.lua`), and none while its answer
//!   cannot have changed: each instance answers it from a view of the room's
//!   counters read every 20 ms and what it learnt of the user (see `view.rs`).
//! - **A room Redis lost comes back.** Joins and settled turns are
//!   journalled in Redis and copied to MySQL in batches (`journal.lua`,
//!   `waiting_room_journal`); a rebuilt room gets them back (`restore.lua`),
//!   with every buyer of the sale settled, before its draw is written again, so
//!   no turn goes to someone who bought or whose turn ran out, and late joiners
//!   keep their place. What the last moment before the loss journalled and had
//!   not copied yet is lost with Redis.
//!
//! Every key lives in the hash tag of the activity's shard 0 (`RoomKeys`).

mod draw;
mod view;

pub use draw::{continue_order, digest, DrawTimes, DRAW_LEASE};
pub use view::{Views, PLACE_CACHE_USERS, VIEW_EVERY, VIEW_MAX_AGE};

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use redis::RedisResult;
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCache};
use crate::config::WaitingRoomSettings;
use crate::orders::OrderRepo;
use crate::stock::{arg, invoke, Lua, RedisConn, RoomKeys, StockStore};

/// Places of late joiners start here: behind every drawn place.
pub const LATE_PLACES: i64 = 1_000_000_000_000;
/// How long after `starts_at` the draw waits, so that a join an instance with a
/// slightly late clock still counted as early is in it.
pub const DRAW_GRACE: Duration = Duration::from_secs(1);
/// Journal rows restored to Redis per `restore.lua` call.
const DRAW_CHUNK: usize = 5_000;
/// How long a reopened room admits nobody: longer than a view of the room
/// answers polls ([`VIEW_MAX_AGE`]), so that no user admitted after a reopening
/// is told `sold_out` from a view read before it.
pub const REOPEN_HOLD: Duration = Duration::from_millis(200);
/// How long a count of unpaid orders is reused (it is read only once nothing is
/// left and nothing is pending).
const UNPAID_TTL: Duration = Duration::from_secs(1);
/// Journal entries copied to MySQL per batch, and batches per step.
const JOURNAL_BATCH: usize = 1_000;
const JOURNAL_BATCHES: usize = 10;
/// How long the instance copying the journal holds it: long enough for a slow
/// MySQL write, short enough that another instance takes over from one that died.
const JOURNAL_LOCK: Duration = Duration::from_secs(10);

/// Where a user stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// Never joined.
    None,
    /// In line; `ahead` once the draw has placed them.
    Waiting { ticket: String, ahead: Option<u64> },
    /// Their turn: reserve before `until` (`None` once they have reserved).
    Admitted {
        ticket: String,
        until: Option<DateTime<Utc>>,
    },
    /// No unit can come back: the sale is over for them.
    SoldOut { ticket: String },
    /// Their turn ran out before they reserved.
    Expired { ticket: String },
}

/// Whether a user may reserve on a sale with a waiting room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Admitted and within their turn, or reserved already.
    Held,
    /// Their turn ran out; a reservation made within it may still stand.
    RanOut,
    /// Not admitted.
    None,
}

/// `place.lua`'s answer: `{state, arrival number, users ahead (-1: not placed
/// or not waiting), admitted until ms (-1: not admitted), the room's
/// generation, turns given, places moved}`.
type PlaceReply = (String, String, i64, i64, String, i64, i64);

/// `join.lua`'s answer: `{code, kind, place…}`.
type JoinReply = (i64, String, String, String, i64, i64, String, i64, i64);

/// What `join.lua` answered.
#[derive(Debug, PartialEq, Eq)]
enum Joined {
    /// Joined just now, `early` or `late`.
    Now { kind: String, reply: PlaceReply },
    /// Joined before.
    Before { reply: PlaceReply },
    /// The room is being rebuilt after Redis lost it.
    Rebuilding,
}

impl Joined {
    /// `{1, kind, place…}` joined now, `{0, "", place…}` joined before, `{-1, …}`
    /// rebuilding.
    fn decode((code, kind, state, seq, ahead, until, gen, given, moved): JoinReply) -> Self {
        let reply = (state, seq, ahead, until, gen, given, moved);
        match code {
            1 => Joined::Now { kind, reply },
            c if c < 0 => Joined::Rebuilding,
            _ => Joined::Before { reply },
        }
    }
}

impl Place {
    /// The place in `place.lua`'s answer.
    fn decode(a: &Activity, (state, seq, ahead, until, ..): &PlaceReply) -> Self {
        let (ahead, until) = (*ahead, *until);
        let ticket = ticket(a, seq);
        match state.as_str() {
            "none" => Place::None,
            "admitted" => Place::Admitted {
                ticket,
                until: (until >= 0)
                    .then(|| DateTime::from_timestamp_millis(until))
                    .flatten(),
            },
            "sold_out" => Place::SoldOut { ticket },
            "expired" => Place::Expired { ticket },
            _ => Place::Waiting {
                ticket,
                ahead: u64::try_from(ahead).ok(),
            },
        }
    }
}

impl Turn {
    /// `turn.lua`'s 1 (may reserve), 2 (ran out) or 0 (not admitted).
    fn decode(code: i64) -> Self {
        match code {
            1 => Turn::Held,
            2 => Turn::RanOut,
            _ => Turn::None,
        }
    }
}

/// What `seal.lua` answered.
#[derive(Debug, PartialEq)]
enum Sealed {
    /// Before the draw is due: nothing sealed.
    Early,
    /// Sealed: this many joined early.
    Due(u64),
}

impl Sealed {
    /// `{"due", count}`, or `{"early"}`.
    fn decode(reply: Vec<String>) -> Self {
        match reply.as_slice() {
            [head, count] if head == "due" => Sealed::Due(count.parse().unwrap_or(0)),
            _ => Sealed::Early,
        }
    }
}

/// What the operators see of a waiting room.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct RoomFigures {
    /// Users who joined, before and after the start.
    pub joined: u64,
    /// In line after the draw (before it: everyone who joined).
    pub waiting: u64,
    /// Holding a turn now.
    pub admitted: u64,
    /// Turns given so far.
    pub admitted_total: u64,
    /// Turns that ran out before their user reserved.
    pub expired_total: u64,
    /// The draw's seed, once drawn.
    pub seed: Option<u64>,
    /// Everyone still waiting was told `sold_out`.
    pub closed: bool,
}

/// A sale's waiting room, holding what it reads: its Redis connection, the
/// stock (admissions follow it), MySQL (the draw and the journal; the unpaid
/// orders) and its settings.
pub struct WaitingRoom {
    conn: RedisConn,
    pool: MySqlPool,
    stock: StockStore,
    orders: OrderRepo,
    settings: WaitingRoomSettings,
    join: Lua,
    draw: Lua,
    lease: Lua,
    admit: Lua,
    turn: Lua,
    settle: Lua,
    status: Lua,
    seal: Lua,
    restore: Lua,
    journal: Lua,
    joins: JoinRecorder,
    unpaid: Mutex<HashMap<String, (Instant, i64)>>,
    /// Polls answered from memory: the rooms' views and the users' places.
    pub views: Views,
    /// Rooms whose draw runs on this instance now.
    drawing: Mutex<HashSet<String>>,
}

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

impl WaitingRoom {
    pub fn new(
        conn: RedisConn,
        pool: MySqlPool,
        stock: StockStore,
        orders: OrderRepo,
        settings: WaitingRoomSettings,
    ) -> Self {
        let joins = JoinRecorder::start(pool.clone());
        WaitingRoom {
            conn,
            orders,
            pool,
            stock,
            settings,
            join: Lua::new(concat!(include_str!("place.lua"), include_str!("join.lua"))),
            draw: Lua::new(include_str!("draw.lua")),
            lease: Lua::new(include_str!("lease.lua")),
            admit: Lua::new(include_str!("admit.lua")),
            turn: Lua::new(include_str!("turn.lua")),
            settle: Lua::new(include_str!("settle.lua")),
            status: Lua::new(concat!(
                include_str!("place.lua"),
                include_str!("status.lua")
            )),
            seal: Lua::new(include_str!("seal.lua")),
            restore: Lua::new(include_str!("restore.lua")),
            journal: Lua::new(include_str!("journal.lua")),
            joins,
            unpaid: Mutex::default(),
            views: Views::default(),
            drawing: Mutex::default(),
        }
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        a: &Activity,
        lua: &Lua,
        args: &[Vec<u8>],
    ) -> RedisResult<T> {
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        invoke(&self.conn, lua, &keys.all(), args).await
    }

    /// Joins `user`, in one script call: their place, and whether they joined
    /// just now; `None` while a room Redis lost is being rebuilt (joining then
    /// would give arrival numbers again from 1).
    pub async fn join(
        &self,
        a: &Activity,
        user: &str,
        now: DateTime<Utc>,
    ) -> RedisResult<Option<(Place, bool)>> {
        let lost_after =
            a.starts_at + chrono::Duration::from_std(DRAW_GRACE * 2).unwrap_or_default();
        let joined = Joined::decode(
            self.run(
                a,
                &self.join,
                &[
                    arg(user),
                    arg(ms(lost_after)),
                    arg(ms(a.starts_at)),
                    arg(LATE_PLACES),
                    arg(ms(now)),
                ],
            )
            .await?,
        );
        Ok(match joined {
            Joined::Rebuilding => None,
            Joined::Now { kind, reply } => {
                if let Ok(n) = reply.1.parse() {
                    self.joins.record(&a.id, user, &kind, n).await;
                }
                Some((self.learnt(a, user, &reply), true))
            }
            Joined::Before { reply } => Some((self.learnt(a, user, &reply), false)),
        })
    }

    /// Where `user` stands: from memory when the answer cannot have changed
    /// since Redis last gave it (see `view.rs`), else in one round trip.
    pub async fn place(&self, a: &Activity, user: &str, now: DateTime<Utc>) -> RedisResult<Place> {
        if let Some(answer) = self.views.answer(&a.id, user) {
            return Ok(answer.place(|seq| ticket(a, &seq.to_string())));
        }
        self.views.count_redis();
        let reply: PlaceReply = self
            .run(a, &self.status, &[arg(user), arg(ms(now))])
            .await?;
        Ok(self.learnt(a, user, &reply))
    }

    /// The place in a reply from Redis, kept for the user's next polls.
    fn learnt(&self, a: &Activity, user: &str, reply: &PlaceReply) -> Place {
        self.views.learn(&a.id, user, reply);
        Place::decode(a, reply)
    }

    /// Whether `user` holds a turn now (or has reserved already).
    pub async fn turn(&self, a: &Activity, user: &str, now: DateTime<Utc>) -> RedisResult<Turn> {
        let turn = self.run(a, &self.turn, &[arg(user), arg(ms(now))]).await?;
        Ok(Turn::decode(turn))
    }

    /// Settles `user`'s turn: their reservation was accepted.
    pub async fn settle(&self, a: &Activity, user: &str) -> RedisResult<()> {
        let _: i64 = self.run(a, &self.settle, &[arg(user)]).await?;
        Ok(())
    }

    pub async fn figures(&self, a: &Activity) -> RedisResult<RoomFigures> {
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        // One slot, so one pipeline works on a Cluster too.
        let (joined, late, queue, admitted, meta): (u64, u64, u64, u64, HashMap<String, String>) =
            redis::pipe()
                .zcard(&keys.joined)
                .zcard(&keys.late)
                .zcard(&keys.queue)
                .zcard(&keys.admitted)
                .hgetall(&keys.meta)
                .query_async(&mut conn)
                .await?;
        let num = |k: &str| meta.get(k).and_then(|v| v.parse().ok());
        let seed = num("seed");
        // While the draw's places are written, the drawn not yet in line and
        // the late joiners wait too.
        let unwritten = num("drawn")
            .unwrap_or(0u64)
            .saturating_sub(num("written").unwrap_or(0));
        let waiting = match (seed, meta.contains_key("complete")) {
            (None, _) => joined + late,
            (Some(_), true) => queue,
            (Some(_), false) => queue + unwritten + late,
        };
        Ok(RoomFigures {
            joined: joined + late,
            waiting,
            admitted,
            admitted_total: num("admitted").unwrap_or(0),
            expired_total: num("expired").unwrap_or(0),
            seed,
            closed: meta.contains_key("closed"),
        })
    }

    /// One upkeep step of an activity's room: once due, the draw runs in the
    /// background (on the instance that holds its lease) until every place is
    /// written and recorded; admissions run from its first places on.
    pub async fn step(
        self: &Arc<Self>,
        a: &Arc<Activity>,
        now: DateTime<Utc>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        if now < a.starts_at + DRAW_GRACE {
            return Ok(());
        }
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        let (seed, complete, recorded): (Option<String>, Option<String>, Option<String>) =
            redis::cmd("HMGET")
                .arg(&keys.meta)
                .arg("seed")
                .arg("complete")
                .arg("recorded")
                .query_async(&mut conn)
                .await
                .context("reading the draw's state")?;
        if complete.is_none() || recorded.is_none() {
            self.spawn_draw(a.clone(), shutdown.clone());
        }
        if seed.is_none() {
            return Ok(());
        }
        let snap = self
            .stock
            .snapshot(&a.id, a.stock_shards)
            .await
            .context("stock snapshot")?;
        // Not loaded (Redis lost it) or paused: no turn is given or taken until
        // the reconciler has rebuilt it or an operator resumes it.
        let Some(left) = snap.stock else {
            return Ok(());
        };
        if snap.state.as_deref() == Some("paused") {
            return Ok(());
        }
        let left = left.max(0);
        let over =
            now >= a.ends_at || (left == 0 && snap.pending == 0 && self.unpaid(a).await? == 0);
        let turn = Duration::from_secs(self.settings.turn_secs);
        let until = now + chrono::Duration::from_std(turn).unwrap_or_default();
        let _: (i64, i64, i64) = self
            .run(
                a,
                &self.admit,
                &[
                    arg(ms(now)),
                    arg(left),
                    arg(if over { "1" } else { "0" }),
                    arg(ms(until)),
                    arg(ms(a.ends_at)),
                    arg(REOPEN_HOLD.as_millis() as u64),
                ],
            )
            .await
            .context("admission step")?;
        Ok(())
    }

    /// Units in orders awaiting payment: they come back if the payment lapses.
    async fn unpaid(&self, a: &Activity) -> anyhow::Result<i64> {
        if let Some((at, n)) = self
            .unpaid
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&a.id)
        {
            if at.elapsed() < UNPAID_TTL {
                return Ok(*n);
            }
        }
        let n = self
            .orders
            .unpaid_units(&a.id)
            .await
            .context("unpaid orders")?;
        self.unpaid
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(a.id.clone(), (Instant::now(), n));
        Ok(n)
    }

    /// A room rebuilt after a loss: its joiners (early ones too, if it was lost
    /// before its draw) and settled turns, before it is sealed.
    async fn restore_journal(&self, a: &Activity, restored: &[JournalRow]) -> anyhow::Result<()> {
        for chunk in restored.chunks(DRAW_CHUNK) {
            let mut args = Vec::with_capacity(chunk.len() * 3);
            for (user, what, seq) in chunk {
                args.extend([arg(user), arg(what), arg(seq)]);
            }
            let _: i64 = self.run(a, &self.restore, &args).await?;
        }
        Ok(())
    }
}

impl WaitingRoom {
    /// Copies the room's journal to MySQL, a batch at a time, when this instance
    /// holds its lock (one instance at a time; entries are dropped from Redis
    /// only once MySQL has them, and only by a holder whose lock still stands).
    async fn copy_journal(&self, a: &Activity) -> anyhow::Result<()> {
        let token = uuid::Uuid::new_v4().to_string();
        let lock_ms = JOURNAL_LOCK.as_millis().to_string();
        for _ in 0..JOURNAL_BATCHES {
            let entries: Vec<String> = self
                .run(
                    a,
                    &self.journal,
                    &[arg(&token), arg(&lock_ms), arg("take"), arg(JOURNAL_BATCH)],
                )
                .await?;
            if entries.is_empty() {
                return Ok(());
            }
            let rows: Vec<JournalRow> = entries.iter().filter_map(|e| parse_entry(e)).collect();
            record_journal(&self.pool, &a.id, &rows).await?;
            let _: Vec<i64> = self
                .run(
                    a,
                    &self.journal,
                    &[arg(&token), arg(&lock_ms), arg("trim"), arg(entries.len())],
                )
                .await?;
            if entries.len() < JOURNAL_BATCH {
                return Ok(());
            }
        }
        Ok(())
    }
}

/// Joins recorded in MySQL before they are answered, in batches (a group
/// commit: one insert for every join that arrived within [`JOIN_BATCH_WAIT`]),
/// so that a `201` survives Redis losing the room right after it. A join whose
/// record does not make it within [`JOIN_RECORD_TIMEOUT`] (MySQL down or slow)
/// is answered all the same: its entry in the room's journal is copied later.
#[derive(Clone)]
struct JoinRecorder {
    queue: tokio::sync::mpsc::Sender<PendingJoin>,
}

struct PendingJoin {
    activity_id: String,
    row: JournalRow,
    done: tokio::sync::oneshot::Sender<()>,
}

const JOIN_BATCH_WAIT: Duration = Duration::from_millis(10);
const JOIN_RECORD_TIMEOUT: Duration = Duration::from_secs(1);
const JOIN_QUEUE: usize = 100_000;

impl JoinRecorder {
    fn start(pool: MySqlPool) -> Self {
        let (queue, mut pending) = tokio::sync::mpsc::channel::<PendingJoin>(JOIN_QUEUE);
        tokio::spawn(async move {
            while let Some(first) = pending.recv().await {
                let mut batch = vec![first];
                let deadline = tokio::time::Instant::now() + JOIN_BATCH_WAIT;
                while batch.len() < JOURNAL_BATCH {
                    match tokio::time::timeout_at(deadline, pending.recv()).await {
                        Ok(Some(join)) => batch.push(join),
                        _ => break,
                    }
                }
                let mut by_activity: HashMap<String, Vec<PendingJoin>> = HashMap::new();
                for join in batch {
                    by_activity
                        .entry(join.activity_id.clone())
                        .or_default()
                        .push(join);
                }
                for (activity_id, joins) in by_activity {
                    let rows: Vec<JournalRow> = joins.iter().map(|j| j.row.clone()).collect();
                    match record_journal(&pool, &activity_id, &rows).await {
                        Ok(()) => {
                            for join in joins {
                                let _ = join.done.send(());
                            }
                        }
                        Err(err) => {
                            tracing::warn!(%activity_id, error = %format!("{err:#}"), "recording joins failed; the journal copies them later");
                        }
                    }
                }
            }
        });
        JoinRecorder { queue }
    }

    /// Records a join and waits for it, at most [`JOIN_RECORD_TIMEOUT`].
    async fn record(&self, activity_id: &str, user: &str, kind: &str, seq: u64) {
        let (done, recorded) = tokio::sync::oneshot::channel();
        let join = PendingJoin {
            activity_id: activity_id.to_owned(),
            row: (user.to_owned(), kind.to_owned(), seq),
            done,
        };
        if self.queue.try_send(join).is_err() {
            return;
        }
        let _ = tokio::time::timeout(JOIN_RECORD_TIMEOUT, recorded).await;
    }
}

/// One journal entry: a user, what happened (`late`, `reserved`, `expired`),
/// and a late joiner's arrival number.
type JournalRow = (String, String, u64);

fn parse_entry(entry: &str) -> Option<JournalRow> {
    let mut parts = entry.split('\t');
    let what = parts.next()?;
    let user = parts.next()?;
    let seq = match what {
        "early" | "late" => parts.next()?.parse().ok()?,
        "reserved" | "expired" => 0,
        _ => return None,
    };
    Some((user.to_owned(), what.to_owned(), seq))
}

async fn record_journal(
    pool: &MySqlPool,
    activity_id: &str,
    rows: &[JournalRow],
) -> anyhow::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut q = sqlx::QueryBuilder::new(
        "INSERT IGNORE INTO waiting_room_journal (activity_id, user_id, kind, joined_seq, recorded_at) ",
    );
    let at = Utc::now().naive_utc();
    q.push_values(rows, |mut b, (user, what, seq)| {
        b.push_bind(activity_id)
            .push_bind(user)
            .push_bind(what)
            .push_bind(*seq)
            .push_bind(at);
    });
    q.build()
        .execute(pool)
        .await
        .context("recording the waiting room's journal")?;
    Ok(())
}

/// What a rebuilt room gets back: every buyer of the sale (`reserved`), the
/// turns that ran out and the late joiners the journal recorded.
async fn load_journal(pool: &MySqlPool, activity_id: &str) -> anyhow::Result<Vec<JournalRow>> {
    let mut rows: Vec<JournalRow> = sqlx::query_as(
        "SELECT user_id, CAST(kind AS CHAR), CAST(COALESCE(joined_seq, 0) AS UNSIGNED) \
         FROM waiting_room_journal WHERE activity_id = ?",
    )
    .bind(activity_id)
    .fetch_all(pool)
    .await
    .context("reading the waiting room's journal")?;
    let buyers: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT holder FROM orders WHERE activity_id = ? AND holder IS NOT NULL",
    )
    .bind(activity_id)
    .fetch_all(pool)
    .await
    .context("reading the sale's buyers")?;
    // Buyers whose settled turn was not journalled (or not copied) yet.
    let journalled: std::collections::HashSet<String> = rows
        .iter()
        .filter(|(_, kind, _)| kind == "reserved")
        .map(|(user, _, _)| user.clone())
        .collect();
    rows.extend(
        buyers
            .into_iter()
            .filter(|u| !journalled.contains(u))
            .map(|u| (u, "reserved".to_owned(), 0)),
    );
    Ok(rows)
}

fn ticket(a: &Activity, seq: &str) -> String {
    format!("{}-{seq}", a.id)
}

/// Fisher–Yates from the last place down, each swap partner `next() % (i + 1)`
/// of SplitMix64 seeded with `seed`: the shuffle behind the draw.
pub fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..items.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// The draw: `users` (in arrival order) in the order [`shuffle`] gives them from
/// `seed`. Anyone can replay it from the recorded seed and arrival order.
pub fn draw_order(users: &[String], seed: u64) -> Vec<String> {
    let mut order = users.to_vec();
    shuffle(&mut order, seed);
    order
}

/// Every instance's upkeep of every waiting room from its start to a minute past
/// its end, each `tick` (the admission steps are atomic, so instances never add
/// up their admissions).
pub async fn run(room: Arc<WaitingRoom>, cache: ActivityCache, shutdown: CancellationToken) {
    tokio::join!(
        admit_every_tick(&room, &cache, shutdown.clone()),
        copy_journals(&room, &cache, shutdown.clone()),
        read_views(&room, &cache, shutdown)
    );
}

/// Every [`VIEW_EVERY`], the counters of each room polled on this instance, in
/// one `HMGET` per room (see `view.rs`); rooms whose sale is over are
/// forgotten.
async fn read_views(room: &WaitingRoom, cache: &ActivityCache, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(VIEW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Utc::now();
        let current: HashMap<String, Arc<Activity>> = cache
            .waiting_rooms(now)
            .into_iter()
            .filter(|a| now <= a.ends_at + chrono::Duration::minutes(1))
            .map(|a| (a.id.clone(), a))
            .collect();
        for id in room.views.polled() {
            let Some(a) = current.get(&id) else {
                room.views.forget(&id);
                continue;
            };
            let keys = RoomKeys::new(&a.id, a.stock_shards);
            let mut conn = room.conn.clone();
            let asked = Instant::now();
            let read: RedisResult<[Option<String>; 5]> = redis::cmd("HMGET")
                .arg(&keys.meta)
                .arg("gen")
                .arg("seed")
                .arg("closed")
                .arg("admitted")
                .arg("moved")
                .query_async(&mut conn)
                .await;
            match read {
                Ok(fields) => room.views.set_view(&id, asked, view::View::decode(fields)),
                Err(err) => {
                    room.views.set_view(&id, asked, None);
                    tracing::debug!(activity_id = %id, error = %err, "reading the room's view failed");
                }
            }
        }
    }
}

/// How often each instance tries to copy the rooms' journals to MySQL, and how
/// long one copy may take: apart from the admissions, so that a slow or
/// unreachable MySQL never holds them up.
const JOURNAL_EVERY: Duration = Duration::from_millis(500);
const JOURNAL_TIMEOUT: Duration = Duration::from_secs(5);

async fn copy_journals(room: &WaitingRoom, cache: &ActivityCache, shutdown: CancellationToken) {
    every_room(JOURNAL_EVERY, cache, shutdown, |a, _| async move {
        match tokio::time::timeout(JOURNAL_TIMEOUT, room.copy_journal(&a)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(activity_id = %a.id, error = %format!("{err:#}"), "copying the waiting room's journal failed");
            }
            Err(_) => {
                tracing::warn!(activity_id = %a.id, "copying the waiting room's journal timed out");
            }
        }
    })
    .await
}

async fn admit_every_tick(
    room: &Arc<WaitingRoom>,
    cache: &ActivityCache,
    shutdown: CancellationToken,
) {
    let every = Duration::from_millis(room.settings.tick_ms);
    let stop = shutdown.clone();
    every_room(every, cache, shutdown, |a, now| {
        let stop = stop.clone();
        async move {
            if let Err(err) = room.step(&a, now, &stop).await {
                tracing::warn!(activity_id = %a.id, error = %format!("{err:#}"), "waiting room step failed");
            }
        }
    })
    .await
}

/// Runs `each` every `every` on each activity with a waiting room, until a minute
/// past its end, until `shutdown`.
async fn every_room<F, Fut>(
    every: Duration,
    cache: &ActivityCache,
    shutdown: CancellationToken,
    mut each: F,
) where
    F: FnMut(Arc<Activity>, DateTime<Utc>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Utc::now();
        for a in cache.waiting_rooms(now) {
            if now > a.ends_at + chrono::Duration::minutes(1) {
                continue;
            }
            each(a, now).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_replies_decode() {
        let s = |v: &str| v.to_owned();
        let place = || (s("waiting"), s("7"), 3, -1, s("g"), 2, 0);
        let joined = |code, kind: &str| {
            let (state, seq, ahead, until, gen, given, moved) = place();
            (code, s(kind), state, seq, ahead, until, gen, given, moved)
        };
        assert_eq!(
            Joined::decode(joined(1, "late")),
            Joined::Now {
                kind: s("late"),
                reply: place()
            }
        );
        assert_eq!(
            Joined::decode(joined(0, "")),
            Joined::Before { reply: place() }
        );
        assert_eq!(Joined::decode(joined(-1, "")), Joined::Rebuilding);
        assert_eq!(
            [0, 1, 2].map(Turn::decode),
            [Turn::None, Turn::Held, Turn::RanOut]
        );
        assert_eq!(Sealed::decode(vec![s("early")]), Sealed::Early);
        assert_eq!(Sealed::decode(Vec::new()), Sealed::Early);
        assert_eq!(Sealed::decode(vec![s("due"), s("12")]), Sealed::Due(12));
    }

    #[test]
    fn the_draw_is_a_permutation_replayed_from_its_seed() {
        let users: Vec<String> = (0..1000).map(|i| format!("u{i}")).collect();
        let a = draw_order(&users, 42);
        assert_eq!(a, draw_order(&users, 42));
        assert_ne!(a, draw_order(&users, 43));
        assert_ne!(a, users);
        let mut sorted = a.clone();
        sorted.sort();
        let mut expected = users.clone();
        expected.sort();
        assert_eq!(sorted, expected);
        assert!(draw_order(&[], 1).is_empty());
    }
}
