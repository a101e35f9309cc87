//! The waiting room (docs/API.md, version 2): a fair draw, and admissions that follow
//! the stock.
//!
//! - **Joining.** From `starts_at − waiting_room_secs` a user joins once
//!   (`join.lua`); their ticket is their arrival number.
//! - **The draw.** Just after `starts_at` (`DRAW_GRACE`, for instances whose clocks
//!   differ a little) the order of everyone who joined before the start is drawn:
//!   a Fisher–Yates shuffle of the users in arrival order driven by SplitMix64 from
//!   a random 53-bit seed ([`draw_order`]). The seed and every user's arrival
//!   number and place are written to MySQL first (`waiting_room_draws`,
//!   `waiting_room_entries`), in one transaction that only one instance wins; the
//!   places then go to Redis (`draw.lua`, idempotent) and the draw is committed
//!   (`commit.lua`). Late joiners queue behind, in arrival order. An auditor
//!   replays the draw from the seed and the arrival order; a Redis that lost the
//!   queue gets the same places back from MySQL.
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
//! - **Cheap to wait.** A join is one script call that answers the place too
//!   (`join.lua`); a poll one (`status.lua`), both built on `place.lua`.
//!   Before the start, polls of users this instance saw join are answered from
//!   memory, checked once a second against Redis ([`early`]); after the draw,
//!   a poll whose answer only the room's moving can change (a place in a line
//!   that has not moved, a repeated `sold_out`) is answered from memory while
//!   this instance's last admission step saw the room unmoved ([`unmoved`]).
//! - **A room Redis lost comes back.** Joins and settled turns are
//!   journalled in Redis and copied to MySQL in batches (`journal.lua`,
//!   `waiting_room_journal`); a rebuilt room gets them back (`restore.lua`),
//!   with every buyer of the sale settled, before its draw is written again, so
//!   no turn goes to someone who bought or whose turn ran out, and late joiners
//!   keep their place. A join is answered only once MySQL has it; a turn given
//!   is journalled with its end, so a turn that ran out in the last moment
//!   before the loss (its `expired` entry not copied yet) is known to have run
//!   out all the same.
//!
//! Every key lives in the hash tag of the activity's shard 0 (`RoomKeys`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use redis::RedisResult;
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCache, LOOKED_AFTER};
use crate::clock::Clock;
use crate::config::WaitingRoomSettings;
use crate::orders::OrderRepo;
use crate::stock::{arg, invoke, Lua, RedisConn, RoomKeys, StockStore};

mod early;
mod unmoved;
use early::{EarlyJoins, Known};
use unmoved::{Mark, Unmoved};

/// How long past a sale's end its room's loop still steps it: every turn
/// given before the end runs out (and is journalled `expired`), and a minute
/// more.
pub fn loop_after_end(turn: Duration) -> chrono::Duration {
    chrono::Duration::from_std(turn).unwrap_or_default() + chrono::Duration::minutes(1)
}
/// Places of late joiners start here: behind every drawn place.
pub const LATE_PLACES: i64 = 1_000_000_000_000;
/// How long after `starts_at` the draw waits, so that a join an instance with a
/// slightly late clock still counted as early is in it.
pub const DRAW_GRACE: Duration = Duration::from_secs(1);
/// Users written to Redis per `draw.lua` call.
const DRAW_CHUNK: usize = 5_000;
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

/// What `join.lua` answered (with the user's place after it, as `status.lua`
/// would answer it).
#[derive(Debug, PartialEq, Eq)]
enum Joined {
    /// Joined just now, with this arrival number, `early` or `late`.
    Now { seq: String, kind: String },
    /// Joined before, with this arrival number, `early` or `late`; whether
    /// MySQL is known to have recorded the join.
    Before {
        seq: String,
        kind: String,
        recorded: bool,
    },
    /// The room is being rebuilt after Redis lost it.
    Rebuilding,
}

/// What a join answers.
#[derive(Debug, PartialEq, Eq)]
pub enum Joining {
    /// In the room, and recorded in MySQL: where the user stands, and whether
    /// they joined just now.
    Joined { place: Place, now: bool },
    /// A room Redis lost is being rebuilt: join again in a moment.
    Rebuilding,
    /// In the room in Redis, but MySQL did not record the join in time (down
    /// or slow): nothing is promised until it does, and joining again keeps
    /// the arrival number.
    NotRecorded,
}

/// `status.lua`'s reply: the place's four values, then the room's mark
/// (generation, admitted, left, closed), then 1 when the room is drawn.
type StatusReply = (String, String, i64, i64, String, i64, i64, i64, i64);

/// `admit.lua`'s reply: admitted and unsettled, admitted now, expired now, the
/// room's mark (generation, admitted, left, closed) and Redis's run id.
type AdmitReply = (i64, i64, i64, String, i64, i64, i64, String);

/// `join.lua`'s reply: `{code, seq, kind}`, the place's four values, the
/// room's generation.
type JoinReply = (i64, String, String, String, String, i64, i64, String);

impl Joined {
    /// `{1, seq, kind, …}` joined now, `{0, seq, kind, …}` joined before (`2`:
    /// and recorded in MySQL),
    /// `{-1, "", "", …}` rebuilding; the place's values in `…`.
    fn decode((code, seq, kind, ..): &JoinReply) -> Self {
        match *code {
            1 => Joined::Now {
                seq: seq.clone(),
                kind: kind.clone(),
            },
            c if c < 0 => Joined::Rebuilding,
            c => Joined::Before {
                seq: seq.clone(),
                kind: kind.clone(),
                recorded: c == 2,
            },
        }
    }
}

impl Place {
    /// `status.lua`'s `{state, arrival number, users ahead (-1: not drawn or not
    /// waiting), admitted until ms (-1: not admitted)}`.
    fn decode(a: &Activity, (state, seq, ahead, until): (String, String, i64, i64)) -> Self {
        let ticket = ticket(a, &seq);
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

/// What sealing the early joins gave.
#[derive(Debug, PartialEq)]
enum Sealed {
    /// Before the draw is due: nothing sealed.
    Early,
    /// Sealed: every early joiner with their arrival number.
    Due(Vec<(String, f64)>),
}

impl Sealed {
    /// `seal.lua`'s `{"due"}` (the joiners are read after it, a page at a
    /// time), or `{"early"}`.
    fn decode(reply: Vec<String>) -> Self {
        match reply.first() {
            Some(head) if head == "due" => Sealed::Due(Vec::new()),
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
    commit: Lua,
    admit: Lua,
    turn: Lua,
    settle: Lua,
    status: Lua,
    seal: Lua,
    restore: Lua,
    mark: Lua,
    journal: Lua,
    check: Lua,
    joins: JoinRecorder,
    unpaid: Mutex<HashMap<String, (Instant, i64)>>,
    early: EarlyJoins,
    unmoved: Unmoved,
    /// Answers of ended rooms Redis no longer holds (see `place_from_journal`).
    ended: Ended,
    /// Per room waiting for its draw: whether Redis lost joins MySQL journalled,
    /// as last found for a generation and a count of early joiners in Redis
    /// (looked up again only when either changes: the look reads every journal
    /// row of the room, and the draw is tried every tick until it is written).
    losses: Mutex<HashMap<String, (String, u64, bool)>>,
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
        let joins = JoinRecorder::start(pool.clone(), conn.clone());
        let settings_remembered = settings.remembered_joins;
        let tick = Duration::from_millis(settings.tick_ms);
        WaitingRoom {
            conn,
            orders,
            pool,
            stock,
            settings,
            join: Lua::new(concat!(include_str!("place.lua"), include_str!("join.lua"))),
            draw: Lua::new(include_str!("draw.lua")),
            commit: Lua::new(include_str!("commit.lua")),
            admit: Lua::new(include_str!("admit.lua")),
            turn: Lua::new(include_str!("turn.lua")),
            settle: Lua::new(include_str!("settle.lua")),
            status: Lua::new(concat!(
                include_str!("place.lua"),
                include_str!("status.lua")
            )),
            seal: Lua::new(include_str!("seal.lua")),
            restore: Lua::new(include_str!("restore.lua")),
            mark: Lua::new(include_str!("mark.lua")),
            journal: Lua::new(include_str!("journal.lua")),
            check: Lua::new(include_str!("check.lua")),
            joins,
            unpaid: Mutex::default(),
            early: EarlyJoins::new(settings_remembered),
            unmoved: Unmoved::new(settings_remembered, tick),
            ended: Mutex::default(),
            losses: Mutex::default(),
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

    /// Joins `user`, in one script call that also answers where they stand:
    /// their place, and whether they joined just now; [`Joining::Rebuilding`]
    /// while a room Redis lost is being rebuilt (joining then would give
    /// arrival numbers again from 1). Always asked of Redis: a user whose join
    /// Redis lost joins again here. A join is answered only once MySQL has
    /// it, the first time and when joining again (the first answer may have
    /// been [`Joining::NotRecorded`]), so that a place told survives Redis
    /// losing the room. What it answers before the start is remembered (see
    /// [`EarlyJoins`]).
    pub async fn join(&self, a: &Activity, user: &str, now: DateTime<Utc>) -> RedisResult<Joining> {
        let lost_after =
            a.starts_at + chrono::Duration::from_std(DRAW_GRACE * 2).unwrap_or_default();
        let reply: JoinReply = self
            .run(
                a,
                &self.join,
                &[
                    arg(user),
                    arg(ms(lost_after)),
                    arg(ms(a.starts_at)),
                    arg(LATE_PLACES),
                    arg(ms(now)),
                    arg(uuid::Uuid::new_v4().simple().to_string()),
                ],
            )
            .await?;
        let joined = Joined::decode(&reply);
        let (.., state, seq, ahead, until, gen) = reply;
        let place = Place::decode(a, (state, seq, ahead, until));
        let (seq, kind, now_joined, recorded) = match joined {
            Joined::Rebuilding => return Ok(Joining::Rebuilding),
            Joined::Now { seq, kind } => (seq, kind, true, false),
            Joined::Before {
                seq,
                kind,
                recorded,
            } => (seq, kind, false, recorded),
        };
        // A join MySQL is known to have costs it nothing again (a reload, a
        // second tab, a poll through POST), even while MySQL is down.
        let recorded = recorded
            || match seq.parse() {
                Ok(n) => self.joins.record(a, &gen, user, &kind, n).await,
                Err(_) => false,
            };
        self.early.learn(a, user, &seq, &place, &gen, now);
        Ok(match recorded {
            true => Joining::Joined {
                place,
                now: now_joined,
            },
            false => Joining::NotRecorded,
        })
    }

    /// Where `user` stands, in one round trip; before the start, from memory
    /// when this instance has seen the user join (see [`EarlyJoins`]); after
    /// the draw, from memory while the room has not moved since Redis last
    /// answered the user (see [`Unmoved`]). `None` once the sale has ended
    /// and Redis holds no drawn room: ask [`WaitingRoom::place_from_journal`].
    pub async fn place(
        &self,
        a: &Activity,
        user: &str,
        now: DateTime<Utc>,
    ) -> RedisResult<Option<Place>> {
        if let Some(place) = self.remembered(a, user, now).await {
            return Ok(Some(place));
        }
        if let Some(place) = self.unmoved.known(&a.id, user, Instant::now()) {
            metrics::counter!("flashsale_waiting_room_answers_from_memory_total").increment(1);
            return Ok(Some(place));
        }
        let (state, seq, ahead, until, gen, admitted, left, closed, drawn): StatusReply = self
            .run(a, &self.status, &[arg(user), arg(ms(now))])
            .await?;
        if drawn == 0 && now >= a.ends_at {
            return Ok(None);
        }
        let place = Place::decode(a, (state, seq.clone(), ahead, until));
        self.early.learn(a, user, &seq, &place, &gen, now);
        if now < a.ends_at {
            let mark = Mark::new(&gen, admitted, left, closed == 1);
            self.unmoved.learn(&a.id, user, mark, &place);
        }
        Ok(Some(place))
    }

    /// `user`'s answer from memory, when it cannot have changed: before the
    /// start, for a user this instance saw join, in a room whose generation,
    /// counter and clock Redis confirmed within the last second (this request
    /// checks it when due; see [`EarlyJoins`]).
    async fn remembered(&self, a: &Activity, user: &str, now: DateTime<Utc>) -> Option<Place> {
        match self.early.known(a, user, now)? {
            Known::Answer(place) => {
                metrics::counter!("flashsale_waiting_room_answers_from_memory_total").increment(1);
                Some(place)
            }
            Known::Unchecked(room, seq) => {
                let guard = room.begin_check()?;
                // What the check asks about is what was learnt before it was
                // sent: an answer Redis gave after it may arrive first.
                let last = room.last();
                let (last_user, last_seq) = match &last {
                    Some((seq, user)) => (user.to_string(), seq.to_string()),
                    None => (String::new(), String::new()),
                };
                let sent = Instant::now();
                let before = ms(self.stock.clock().now());
                let reply: RedisResult<(String, u64, i64, String, i64, i64)> = self
                    .run(a, &self.check, &[arg(&last_user), arg(&last_seq)])
                    .await;
                let after = ms(self.stock.clock().now());
                let verdict = match reply {
                    Ok((gen, counter, kept, run_id, secs, micros)) => {
                        let reply = early::CheckReply {
                            gen,
                            counter,
                            last_kept: kept == 1,
                            run_id,
                            redis_ms: secs * 1_000 + micros / 1_000,
                        };
                        early::verdict(&room, last.map(|(seq, _)| seq), &reply, before, after)
                    }
                    Err(err) => {
                        tracing::debug!(activity_id = %a.id, error = %err, "checking a remembered room failed");
                        early::Verdict::Unsure
                    }
                };
                match verdict {
                    early::Verdict::Confirmed => {
                        guard.confirmed(sent);
                        Some(early::waiting(a, seq))
                    }
                    early::Verdict::Lost => {
                        self.early.forget_gen(&a.id, room.gen());
                        None
                    }
                    early::Verdict::Unsure => {
                        guard.distrust();
                        None
                    }
                }
            }
        }
    }

    /// Where `user` stood when the sale ended, from MySQL, for an ended sale
    /// whose room Redis no longer holds (its state removed after the
    /// retention, or lost): the answer Redis gave once the room closed, a
    /// buyer `admitted` (reserved), a turn that ran out (or was given and not
    /// used: by the end it ran out) `expired`, anyone else
    /// who joined `sold_out`, with their ticket (their arrival number, from
    /// the journal or the draw); `None` for a user who never joined. Nothing
    /// changes these any more, so each instance keeps them (up to
    /// `remembered_joins`; past it, it forgets them all and reads again).
    pub async fn place_from_journal(&self, a: &Activity, user: &str) -> anyhow::Result<Place> {
        if let Some(place) = lock_ended(&self.ended)
            .get(&a.id)
            .and_then(|room| room.get(user))
        {
            return Ok(place.clone());
        }
        // A buyer is one by their order, whether or not their settled turn
        // was journalled before Redis lost it.
        let mut rows: Vec<(String, u64)> = sqlx::query_as(
            "SELECT CAST(kind AS CHAR), CAST(COALESCE(joined_seq, 0) AS UNSIGNED) \
             FROM waiting_room_journal WHERE activity_id = ? AND user_id = ? \
             UNION ALL \
             SELECT 'drawn', joined_seq FROM waiting_room_entries \
             WHERE activity_id = ? AND user_id = ? \
             UNION ALL \
             SELECT 'reserved', CAST(0 AS UNSIGNED) FROM orders WHERE activity_id = ? AND holder = ?",
        )
        .bind(&a.id)
        .bind(user)
        .bind(&a.id)
        .bind(user)
        .bind(&a.id)
        .bind(user)
        .fetch_all(&self.pool)
        .await
        .context("reading the room's journal")?;
        rows.extend(
            load_turns(&self.pool, &a.id, Some(user))
                .await?
                .into_iter()
                .map(|(_, kind, ends)| (kind, ends)),
        );
        let place = ended_place(a, &rows);
        let mut ended = lock_ended(&self.ended);
        let held: usize = ended.values().map(HashMap::len).sum();
        if held >= self.settings.remembered_joins {
            ended.clear();
        }
        // A user who never joined is not kept: a flood of unknown ids would
        // push the real answers out.
        if self.settings.remembered_joins > 0 && place != Place::None {
            ended
                .entry(a.id.clone())
                .or_default()
                .insert(user.to_owned(), place.clone());
        }
        Ok(place)
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
        Ok(RoomFigures {
            joined: joined + late,
            waiting: if seed.is_some() { queue } else { joined + late },
            admitted,
            admitted_total: num("admitted").unwrap_or(0),
            expired_total: num("expired").unwrap_or(0),
            seed,
            closed: meta.contains_key("closed"),
        })
    }

    /// One upkeep step of an activity's room: the draw once due, then admissions.
    pub async fn step(&self, a: &Activity, now: DateTime<Utc>) -> anyhow::Result<()> {
        if !EarlyJoins::before_start(a, now) {
            self.early.forget(&a.id);
        }
        if now >= a.ends_at {
            self.unmoved.forget(&a.id);
        }
        metrics::gauge!("flashsale_waiting_room_remembered_joins").set(self.early.len() as f64);
        metrics::gauge!("flashsale_waiting_room_remembered_places").set(self.unmoved.len() as f64);
        if now < a.starts_at + DRAW_GRACE {
            return Ok(());
        }
        // After the end, a room Redis no longer holds drawn (lost, or removed
        // while this instance's clock lags) is not drawn again: its polls are
        // answered from MySQL's journal, and a room built now would never be
        // removed.
        if now >= a.ends_at && !self.drawn(a).await? {
            return Ok(());
        }
        self.ensure_drawn(a).await?;
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
        let all_sold = left == 0 && snap.pending == 0 && self.unpaid(a).await? == 0;
        // The time again, after the draw, the snapshot and MySQL: a draw of a
        // large room takes seconds, and turns given from the tick's time would
        // be shorter by as much (and run out early).
        let now = self.stock.clock().now();
        let over = now >= a.ends_at || all_sold;
        let turn = Duration::from_secs(self.settings.turn_secs);
        let until = now + chrono::Duration::from_std(turn).unwrap_or_default();
        let (_, _, _, gen, admitted, left_line, closed, run_id): AdmitReply = self
            .run(
                a,
                &self.admit,
                &[
                    arg(ms(now)),
                    arg(left),
                    arg(if over { "1" } else { "0" }),
                    arg(ms(until)),
                    arg(ms(a.ends_at)),
                ],
            )
            .await
            .context("admission step")?;
        if gen.is_empty() || now >= a.ends_at {
            self.unmoved.forget(&a.id);
        } else {
            let mark = Mark::new(&gen, admitted, left_line, closed == 1);
            self.unmoved.saw(&a.id, mark, &run_id, Instant::now());
        }
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

    /// Whether Redis holds the room drawn (a room rebuilt after a loss is
    /// drawn again).
    async fn drawn(&self, a: &Activity) -> redis::RedisResult<bool> {
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        redis::cmd("HEXISTS")
            .arg(&keys.meta)
            .arg("seed")
            .query_async(&mut conn)
            .await
    }

    /// The room's generation: which life in Redis it is (`None`: no room
    /// there).
    async fn generation(&self, a: &Activity) -> redis::RedisResult<Option<String>> {
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        redis::cmd("HGET")
            .arg(&keys.meta)
            .arg("gen")
            .query_async(&mut conn)
            .await
    }

    /// The draw, in MySQL then in Redis, unless Redis has it already.
    async fn ensure_drawn(&self, a: &Activity) -> anyhow::Result<()> {
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        let (committed, gen, early): (bool, Option<String>, u64) = redis::pipe()
            .hexists(&keys.meta, "seed")
            .hget(&keys.meta, "gen")
            .zcard(&keys.joined)
            .query_async(&mut conn)
            .await?;
        if committed {
            self.losses
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&a.id);
            return Ok(());
        }
        // A room Redis never lost anything of holds every join: it seals and
        // draws from Redis alone, and another instance's draw recorded first is
        // taken when this one's record loses (`new_draw`). Only a room that lost
        // something reads back what MySQL knows of it: the draw, the joiners and
        // settled turns, and so the highest arrival number.
        let whole = match &gen {
            Some(gen) => !self.lost_joins(a, gen, early).await?,
            None => false,
        };
        let (recorded, restored) = if whole {
            (None, Vec::new())
        } else {
            (
                load_draw(&self.pool, &a.id).await?,
                load_journal(&self.pool, &a.id).await?,
            )
        };
        let highest = recorded
            .iter()
            .flat_map(|(_, order)| order.iter().map(|(_, seq)| *seq))
            .chain(
                restored
                    .iter()
                    .filter(|(_, kind, _)| kind == "early" || kind == "late")
                    .map(|(_, _, seq)| *seq),
            )
            .max()
            .unwrap_or(0);
        self.restore_journal(a, &restored).await?;
        let Sealed::Due(joined) = self.seal_early_joins(a, highest).await? else {
            return Ok(());
        };
        let (seed, order) = match recorded {
            Some(draw) => draw,
            None => self.new_draw(a, joined).await?,
        };
        self.write_draw(a, seed, &order).await
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

    /// Seals the early joins once the draw is due, numbering any join after
    /// that above `highest`.
    async fn seal_early_joins(&self, a: &Activity, highest: u64) -> anyhow::Result<Sealed> {
        let due = a.starts_at + chrono::Duration::from_std(DRAW_GRACE).unwrap_or_default();
        let sealed = self
            .run(a, &self.seal, &[arg(ms(due)), arg(highest)])
            .await?;
        if Sealed::decode(sealed) == Sealed::Early {
            return Ok(Sealed::Early);
        }
        // Sealed: the early joiners no longer change. Read a page at a time in
        // arrival order (a million in one reply would hold Redis for seconds,
        // past every client's timeout).
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        let mut joined: Vec<(String, f64)> = Vec::new();
        loop {
            let after = match joined.last() {
                Some((_, seq)) => format!("({seq}"),
                None => "-inf".to_owned(),
            };
            let page: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
                .arg(&keys.joined)
                .arg(after)
                .arg("+inf")
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(DRAW_CHUNK)
                .query_async(&mut conn)
                .await
                .context("reading the sealed early joiners")?;
            let full = page.len() == DRAW_CHUNK;
            joined.extend(page);
            if !full {
                return Ok(Sealed::Due(joined));
            }
        }
    }

    /// Draws the early joiners' order and records it in MySQL, or takes the
    /// draw another instance recorded first.
    async fn new_draw(
        &self,
        a: &Activity,
        joined: Vec<(String, f64)>,
    ) -> anyhow::Result<(u64, Vec<(String, u64)>)> {
        let arrivals: Vec<(String, u64)> = joined.into_iter().map(|(u, s)| (u, s as u64)).collect();
        let seed = new_seed();
        let users: Vec<String> = arrivals.iter().map(|(u, _)| u.clone()).collect();
        let seq_of: HashMap<String, u64> = arrivals.into_iter().collect();
        let order: Vec<(String, u64)> = draw_order(&users, seed)
            .into_iter()
            .map(|u| {
                let seq = seq_of.get(&u).copied().unwrap_or(0);
                (u, seq)
            })
            .collect();
        if record_draw(&self.pool, &a.id, seed, &order).await? {
            tracing::info!(activity_id = %a.id, seed, joined = order.len(), "waiting room drawn");
            Ok((seed, order))
        } else {
            load_draw(&self.pool, &a.id)
                .await?
                .context("a draw recorded by another instance vanished")
        }
    }

    /// Writes the drawn places to Redis, then commits the draw.
    async fn write_draw(
        &self,
        a: &Activity,
        seed: u64,
        order: &[(String, u64)],
    ) -> anyhow::Result<()> {
        for (i, chunk) in order.chunks(DRAW_CHUNK).enumerate() {
            let mut args = vec![arg(seed), arg(i * DRAW_CHUNK)];
            for (user, seq) in chunk {
                args.push(arg(user));
                args.push(arg(seq));
            }
            let _: i64 = self.run(a, &self.draw, &args).await?;
        }
        let _: i64 = self
            .run(
                a,
                &self.commit,
                &[arg(seed), arg(order.len()), arg(LATE_PLACES)],
            )
            .await?;
        Ok(())
    }
}

impl WaitingRoom {
    /// Copies the room's journal to MySQL, a batch at a time, when this instance
    /// holds its lock (one instance at a time; entries are dropped from Redis
    /// only once MySQL has them, and only by a holder whose lock still stands).
    async fn copy_journal(&self, a: &Activity) -> anyhow::Result<()> {
        let token = uuid::Uuid::new_v4().to_string();
        // Read before the entries: if Redis lost the room in between, entries of
        // its next life are labelled with this one, which only makes the draw
        // read the journal back (never the other way round).
        let gen = self.generation(a).await?.unwrap_or_default();
        let keys = RoomKeys::new(&a.id, a.stock_shards);
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
            let (turns, rows): (Vec<JournalRow>, Vec<JournalRow>) = entries
                .iter()
                .filter_map(|e| parse_entry(e))
                .partition(|(_, kind, _)| kind == "admitted");
            record_journal(&self.pool, &a.id, &gen, &rows).await?;
            record_turns(&self.pool, &a.id, &turns).await?;
            mark_recorded(&self.conn, &self.mark, &keys, &gen, &rows).await;
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
/// is answered `503`: its entry in the room's journal is copied later, and
/// joining again records it before the answer.
#[derive(Clone)]
struct JoinRecorder {
    queue: tokio::sync::mpsc::Sender<PendingJoin>,
}

struct PendingJoin {
    activity_id: String,
    /// The room's keys (to mark the join recorded, `mark.lua`).
    keys: RoomKeys,
    /// The room's generation in Redis the join was answered from.
    gen: String,
    row: JournalRow,
    done: tokio::sync::oneshot::Sender<()>,
}

const JOIN_BATCH_WAIT: Duration = Duration::from_millis(10);
const JOIN_RECORD_TIMEOUT: Duration = Duration::from_secs(1);
const JOIN_QUEUE: usize = 100_000;
/// Batches of joins inserted at once.
const JOIN_INSERTS: usize = 4;

impl JoinRecorder {
    fn start(pool: MySqlPool, conn: RedisConn) -> Self {
        let (queue, mut pending) = tokio::sync::mpsc::channel::<PendingJoin>(JOIN_QUEUE);
        let mark = Lua::new(include_str!("mark.lua"));
        let inserts = Arc::new(tokio::sync::Semaphore::new(JOIN_INSERTS));
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
                let mut by_room: HashMap<(String, String), Vec<PendingJoin>> = HashMap::new();
                // A join whose request gave up (answered `503`) is left to the
                // journal's copy: a backlog after MySQL's return is not made of
                // joins nobody waits for.
                for join in batch.into_iter().filter(|j| !j.done.is_closed()) {
                    by_room
                        .entry((join.activity_id.clone(), join.gen.clone()))
                        .or_default()
                        .push(join);
                }
                for ((activity_id, gen), joins) in by_room {
                    // A few inserts at once: a join waits for its own, and a
                    // crowd arriving at the room's opening is not answered
                    // `503` for a queue of batches ahead of it.
                    let Ok(permit) = inserts.clone().acquire_owned().await else {
                        return;
                    };
                    let (pool, conn, mark) = (pool.clone(), conn.clone(), mark.clone());
                    tokio::spawn(async move {
                        // Those who gave up while the batch waited for its turn
                        // are left to the copy too.
                        let joins: Vec<PendingJoin> =
                            joins.into_iter().filter(|j| !j.done.is_closed()).collect();
                        let Some(keys) = joins.first().map(|j| j.keys.clone()) else {
                            return;
                        };
                        let rows: Vec<JournalRow> = joins.iter().map(|j| j.row.clone()).collect();
                        match record_journal(&pool, &activity_id, &gen, &rows).await {
                            Ok(()) => {
                                for join in joins {
                                    let _ = join.done.send(());
                                }
                                drop(permit);
                                mark_recorded(&conn, &mark, &keys, &gen, &rows).await;
                                return;
                            }
                            Err(err) => {
                                tracing::warn!(%activity_id, error = %format!("{err:#}"), "recording joins failed; they are answered 503, and the journal copies them later");
                            }
                        }
                        drop(permit);
                    });
                }
            }
        });
        JoinRecorder { queue }
    }

    /// Records a join and waits for it, at most [`JOIN_RECORD_TIMEOUT`];
    /// whether MySQL has it.
    async fn record(&self, a: &Activity, gen: &str, user: &str, kind: &str, seq: u64) -> bool {
        let (done, recorded) = tokio::sync::oneshot::channel();
        let join = PendingJoin {
            activity_id: a.id.clone(),
            keys: RoomKeys::new(&a.id, a.stock_shards),
            gen: gen.to_owned(),
            row: (user.to_owned(), kind.to_owned(), seq),
            done,
        };
        if self.queue.try_send(join).is_err() {
            return false;
        }
        matches!(
            tokio::time::timeout(JOIN_RECORD_TIMEOUT, recorded).await,
            Ok(Ok(()))
        )
    }
}

/// One journal entry: a user, what happened (`early`, `late`, `admitted`,
/// `reserved`, `expired`), and a joiner's arrival number or the end of a
/// turn given (ms).
type JournalRow = (String, String, u64);

fn parse_entry(entry: &str) -> Option<JournalRow> {
    let mut parts = entry.split('\t');
    let what = parts.next()?;
    let user = parts.next()?;
    let seq = match what {
        "early" | "late" | "admitted" => parts.next()?.parse().ok()?,
        "reserved" | "expired" => 0,
        _ => return None,
    };
    Some((user.to_owned(), what.to_owned(), seq))
}

/// Records journal rows of the room's life `gen` in Redis ("" when unknown:
/// such a row counts as another life's, and the draw reads the journal back).
/// Rows go in in one order (user, then kind), so that two inserts of
/// overlapping rows (the join recorder's, the journal's copy) take their locks
/// in the same order.
async fn record_journal(
    pool: &MySqlPool,
    activity_id: &str,
    gen: &str,
    rows: &[JournalRow],
) -> anyhow::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut rows = rows.to_vec();
    rows.sort_by(|x, y| (&x.0, &x.1).cmp(&(&y.0, &y.1)));
    let mut q = sqlx::QueryBuilder::new(
        "INSERT IGNORE INTO waiting_room_journal (activity_id, user_id, kind, joined_seq, recorded_at, gen) ",
    );
    let at = Utc::now().naive_utc();
    let gen = (!gen.is_empty()).then_some(gen);
    q.push_values(&rows, |mut b, (user, what, seq)| {
        b.push_bind(activity_id)
            .push_bind(user)
            .push_bind(what)
            .push_bind(*seq)
            .push_bind(at)
            .push_bind(gen);
    });
    q.build()
        .execute(pool)
        .await
        .context("recording the waiting room's journal")?;
    Ok(())
}

/// Records the turns given (`admitted` entries: the user and the turn's end),
/// keeping the later end of a turn given again after a rebuild. Until
/// `flashsale migrate` has made their table (an instance of this release may
/// run against the last one's schema for a while) they are dropped, and the
/// rest of the journal is copied all the same.
async fn record_turns(
    pool: &MySqlPool,
    activity_id: &str,
    rows: &[JournalRow],
) -> anyhow::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut rows = rows.to_vec();
    rows.sort();
    let mut q = sqlx::QueryBuilder::new(
        "INSERT INTO waiting_room_turns (activity_id, user_id, ends_at_ms) ",
    );
    q.push_values(&rows, |mut b, (user, _, ends)| {
        b.push_bind(activity_id).push_bind(user).push_bind(*ends);
    });
    q.push(" ON DUPLICATE KEY UPDATE ends_at_ms = GREATEST(ends_at_ms, VALUES(ends_at_ms))");
    match q.build().execute(pool).await {
        Ok(_) => Ok(()),
        Err(err) if no_such_table(&err) => {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(%activity_id, "turns given are not recorded: the table waiting_room_turns is missing (run `flashsale migrate`)");
            }
            Ok(())
        }
        Err(err) => Err(err).context("recording the waiting room's turns"),
    }
}

/// The turns a room gave, as `admitted` journal rows (none before `flashsale
/// migrate` made their table).
async fn load_turns(
    pool: &MySqlPool,
    activity_id: &str,
    user: Option<&str>,
) -> anyhow::Result<Vec<JournalRow>> {
    let rows: Result<Vec<(String, u64)>, sqlx::Error> = match user {
        None => sqlx::query_as(
            "SELECT CAST(user_id AS CHAR), ends_at_ms FROM waiting_room_turns WHERE activity_id = ?",
        )
        .bind(activity_id)
        .fetch_all(pool)
        .await,
        Some(user) => sqlx::query_as(
            "SELECT CAST(user_id AS CHAR), ends_at_ms FROM waiting_room_turns \
             WHERE activity_id = ? AND user_id = ?",
        )
        .bind(activity_id)
        .bind(user)
        .fetch_all(pool)
        .await,
    };
    match rows {
        Ok(rows) => Ok(rows
            .into_iter()
            .map(|(user, ends)| (user, "admitted".to_owned(), ends))
            .collect()),
        Err(err) if no_such_table(&err) => Ok(Vec::new()),
        Err(err) => Err(err).context("reading the waiting room's turns"),
    }
}

/// Whether MySQL answered that a table does not exist (1146).
fn no_such_table(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|e| e.number() == 1146)
}

/// How long marking joins recorded may take; past it they stay unmarked.
const MARK_TIMEOUT: Duration = Duration::from_millis(500);

/// Marks the joiners of `rows` as recorded in MySQL (`mark.lua`, in the
/// room's life `gen` only), after their answers: best effort, within
/// [`MARK_TIMEOUT`]. A joiner left unmarked is recorded again (`INSERT
/// IGNORE`) when they join again.
async fn mark_recorded(
    conn: &RedisConn,
    mark: &Lua,
    keys: &RoomKeys,
    gen: &str,
    rows: &[JournalRow],
) {
    let users: Vec<&str> = rows
        .iter()
        .filter(|(_, kind, _)| kind == "early" || kind == "late")
        .map(|(user, _, _)| user.as_str())
        .collect();
    if users.is_empty() || gen.is_empty() {
        return;
    }
    let mut args = Vec::with_capacity(users.len() + 1);
    args.push(arg(gen));
    args.extend(users.into_iter().map(arg));
    let marked =
        tokio::time::timeout(MARK_TIMEOUT, invoke::<i64>(conn, mark, &keys.all(), &args)).await;
    if !matches!(marked, Ok(Ok(_))) {
        tracing::debug!("marking joins recorded failed; joining again records them again");
    }
}

impl WaitingRoom {
    /// [`lost_joins`], looked up again only when the room's generation or its
    /// count of early joiners in Redis changed since the last look.
    async fn lost_joins(&self, a: &Activity, gen: &str, early: u64) -> anyhow::Result<bool> {
        if let Some((seen_gen, seen_early, lost)) = self
            .losses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&a.id)
        {
            if seen_gen == gen && *seen_early == early {
                return Ok(*lost);
            }
        }
        let lost = lost_joins(&self.pool, &a.id, gen, early).await?;
        self.losses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(a.id.clone(), (gen.to_owned(), early, lost));
        Ok(lost)
    }
}

/// Whether Redis lost joins of the room that MySQL journalled: a row from a
/// life in Redis other than `gen` (or from before lives were recorded: the
/// room was lost whole and made again), or more early joiners than Redis holds
/// (`early`: some were lost while the room lived on, to a failover to a replica
/// that missed them, say). One aggregate in MySQL, nothing sent back but two
/// numbers.
async fn lost_joins(
    pool: &MySqlPool,
    activity_id: &str,
    gen: &str,
    early: u64,
) -> anyhow::Result<bool> {
    let (journalled, other_lives): (i64, i64) = sqlx::query_as(
        "SELECT CAST(COALESCE(SUM(kind = 'early'), 0) AS SIGNED), \
                CAST(COALESCE(SUM(gen IS NULL OR gen <> ?), 0) AS SIGNED) \
         FROM waiting_room_journal WHERE activity_id = ?",
    )
    .bind(gen)
    .bind(activity_id)
    .fetch_one(pool)
    .await
    .context("comparing the room's journal with Redis")?;
    Ok(other_lives > 0 || u64::try_from(journalled).unwrap_or(u64::MAX) > early)
}

/// What a rebuilt room gets back: every buyer of the sale (`reserved`), the
/// turns given and those that ran out, and the joiners the journal recorded.
async fn load_journal(pool: &MySqlPool, activity_id: &str) -> anyhow::Result<Vec<JournalRow>> {
    let mut rows: Vec<JournalRow> = sqlx::query_as(
        "SELECT CAST(user_id AS CHAR), CAST(kind AS CHAR), CAST(COALESCE(joined_seq, 0) AS UNSIGNED) \
         FROM waiting_room_journal WHERE activity_id = ?",
    )
    .bind(activity_id)
    .fetch_all(pool)
    .await
    .context("reading the waiting room's journal")?;
    let buyers: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(holder AS CHAR) FROM orders WHERE activity_id = ? AND holder IS NOT NULL \
         GROUP BY holder",
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
    rows.extend(load_turns(pool, activity_id, None).await?);
    Ok(rows)
}

/// The answer of an ended room to a user, from their rows in MySQL: the
/// journal's (`early`, `late` with the arrival number; `reserved`, `expired`)
/// and the draw's (`drawn`, with the arrival number).
fn ended_place(a: &Activity, rows: &[(String, u64)]) -> Place {
    let kind = |k: &str| rows.iter().any(|(kind, _)| kind == k);
    // As place.lua reads it: the early join's number (the draw's, the same)
    // before a late one's (a drawn user who joined again during a rebuild).
    let seq = rows
        .iter()
        .find(|(kind, _)| matches!(kind.as_str(), "early" | "drawn"))
        .or_else(|| rows.iter().find(|(kind, _)| kind == "late"))
        .map(|(_, seq)| *seq);
    let Some(seq) = seq else {
        return Place::None;
    };
    let ticket = ticket(a, &seq.to_string());
    if kind("reserved") {
        Place::Admitted {
            ticket,
            until: None,
        }
    } else if kind("expired") || kind("admitted") {
        // A turn given and not used ran out by the end (its `expired` entry
        // may have been lost with Redis before it was copied).
        Place::Expired { ticket }
    } else {
        Place::SoldOut { ticket }
    }
}

/// Ended rooms' answers, by activity and user.
type Ended = Mutex<HashMap<String, HashMap<String, Place>>>;

fn lock_ended(m: &Ended) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, Place>>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ticket(a: &Activity, seq: &str) -> String {
    format!("{}-{seq}", a.id)
}

/// A random seed below 2^53, so a metrics gauge shows it exactly.
fn new_seed() -> u64 {
    (uuid::Uuid::new_v4().as_u128() as u64) & ((1 << 53) - 1)
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

/// Records the draw (users in drawn order, with their arrival numbers) unless
/// another instance did first (then `false`).
async fn record_draw(
    pool: &MySqlPool,
    activity_id: &str,
    seed: u64,
    order: &[(String, u64)],
) -> anyhow::Result<bool> {
    let mut tx = pool.begin().await?;
    let done = sqlx::query(
        "INSERT IGNORE INTO waiting_room_draws (activity_id, seed, joined, drawn_at) \
         VALUES (?, ?, ?, ?)",
    )
    .bind(activity_id)
    .bind(seed)
    .bind(u32::try_from(order.len()).context("too many joined")?)
    .bind(Utc::now().naive_utc())
    .execute(&mut *tx)
    .await?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    for (c, chunk) in order.chunks(1000).enumerate() {
        let mut q = sqlx::QueryBuilder::new(
            "INSERT INTO waiting_room_entries (activity_id, position, user_id, joined_seq) ",
        );
        q.push_values(chunk.iter().enumerate(), |mut b, (i, (user, seq))| {
            b.push_bind(activity_id)
                .push_bind((c * 1000 + i + 1) as u32)
                .push_bind(user)
                .push_bind(*seq);
        });
        q.build().execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// The recorded draw: its seed, and the users in their drawn order with their
/// arrival numbers.
pub async fn load_draw(
    pool: &MySqlPool,
    activity_id: &str,
) -> anyhow::Result<Option<(u64, Vec<(String, u64)>)>> {
    let seed: Option<u64> =
        sqlx::query_scalar("SELECT seed FROM waiting_room_draws WHERE activity_id = ?")
            .bind(activity_id)
            .fetch_optional(pool)
            .await?;
    let Some(seed) = seed else {
        return Ok(None);
    };
    let order: Vec<(String, u64)> = sqlx::query_as(
        "SELECT CAST(user_id AS CHAR), joined_seq FROM waiting_room_entries WHERE activity_id = ? ORDER BY position",
    )
    .bind(activity_id)
    .fetch_all(pool)
    .await?;
    Ok(Some((seed, order)))
}

/// Every instance's upkeep of every waiting room from its start to a minute past
/// its end, each `tick` (the admission steps are atomic, so instances never add
/// up their admissions).
pub async fn run(room: Arc<WaitingRoom>, cache: ActivityCache, shutdown: CancellationToken) {
    tokio::join!(
        admit_every_tick(&room, &cache, shutdown.clone()),
        copy_journals(&room, &cache, shutdown)
    );
}

/// How often each instance tries to copy the rooms' journals to MySQL, and how
/// long one copy may take: apart from the admissions, so that a slow or
/// unreachable MySQL never holds them up.
const JOURNAL_EVERY: Duration = Duration::from_millis(500);
const JOURNAL_TIMEOUT: Duration = Duration::from_secs(5);

async fn copy_journals(room: &WaitingRoom, cache: &ActivityCache, shutdown: CancellationToken) {
    // Until every entry is copied: a room's state is removed only once its
    // journal is empty (see `reconcile::retention`).
    every_room(JOURNAL_EVERY, LOOKED_AFTER, room.stock.clock(), cache, shutdown, |a, _| async move {
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

async fn admit_every_tick(room: &WaitingRoom, cache: &ActivityCache, shutdown: CancellationToken) {
    let every = Duration::from_millis(room.settings.tick_ms);
    let after_end = loop_after_end(Duration::from_secs(room.settings.turn_secs));
    every_room(every, after_end, room.stock.clock(), cache, shutdown, |a, now| async move {
        if let Err(err) = room.step(&a, now).await {
            tracing::warn!(activity_id = %a.id, error = %format!("{err:#}"), "waiting room step failed");
        }
    })
    .await
}

/// Runs `each` every `every` on each activity with a waiting room, until
/// `after_end` past its end (and while the cache keeps it: an hour, until its
/// state is removed), until `shutdown`.
async fn every_room<F, Fut>(
    every: Duration,
    after_end: chrono::Duration,
    clock: &Clock,
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
        let now = clock.now();
        for a in cache.waiting_rooms(now) {
            if now > a.ends_at + after_end {
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
        let waiting = |code, seq: &str, kind: &str| {
            (code, s(seq), s(kind), s("waiting"), s(seq), -1, -1, s("g"))
        };
        assert_eq!(
            Joined::decode(&waiting(1, "7", "late")),
            Joined::Now {
                seq: s("7"),
                kind: s("late")
            }
        );
        assert_eq!(
            Joined::decode(&waiting(0, "7", "early")),
            Joined::Before {
                seq: s("7"),
                kind: s("early"),
                recorded: false
            }
        );
        assert_eq!(
            Joined::decode(&waiting(2, "7", "late")),
            Joined::Before {
                seq: s("7"),
                kind: s("late"),
                recorded: true
            }
        );
        assert_eq!(
            Joined::decode(&(-1, s(""), s(""), s("none"), s(""), -1, -1, s(""))),
            Joined::Rebuilding
        );
        assert_eq!(
            [0, 1, 2].map(Turn::decode),
            [Turn::None, Turn::Held, Turn::RanOut]
        );
        assert_eq!(Sealed::decode(vec![s("early")]), Sealed::Early);
        assert_eq!(Sealed::decode(Vec::new()), Sealed::Early);
        assert_eq!(Sealed::decode(vec![s("due")]), Sealed::Due(Vec::new()));
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
