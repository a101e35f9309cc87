//! The draw, written so that the front of the line is admitted at once, and
//! recorded in MySQL in batches meanwhile.
//!
//! One instance at a time runs a room's draw (the draw's lease in Redis,
//! renewed at every step; another instance takes over within [`DRAW_LEASE`]
//! when it dies):
//! 1. a room Redis lost is restored from MySQL first (its joiners, settled
//!    turns), then the early joins are sealed (`seal.lua`);
//! 2. the sealed early joiners are read in arrival order, a page at a time
//!    (they cannot change any more), and their digest computed ([`digest`]);
//! 3. the draw's header goes to MySQL (`waiting_room_draws`: seed, joined,
//!    digest): the first instance's insert wins, every later one takes its seed
//!    and becomes the recorder (`recorder`, so that a recorder that was taken
//!    over records nothing more);
//! 4. the order ([`continue_order`]: the places MySQL recorded already, then
//!    the rest in drawn order) goes to Redis as one growing prefix of places
//!    (`draw.lua`): a first small part, then larger ones. Admissions run from
//!    the first part on;
//! 5. the places are recorded in MySQL (`waiting_room_entries`) in batches, each
//!    in one transaction with the count recorded so far, and the room is marked
//!    `recorded` in Redis.
//!
//! Every step may run twice, race or stop half-way: places are written as a
//! prefix from the same order (a part that would leave a gap or was written
//! before writes nothing), batches continue from MySQL's count under a row lock
//! held by the recorder of the moment.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

use super::{arg, load_journal, ms, shuffle, Sealed, WaitingRoom, DRAW_GRACE};
use super::{JournalRow, LATE_PLACES};
use crate::activity::Activity;
use crate::stock::RoomKeys;

/// How long the draw's lease lasts unless renewed: the longest pause before
/// another instance continues a draw whose instance died.
pub const DRAW_LEASE: Duration = Duration::from_secs(5);
/// Places in the first part written to Redis: small, so the first admissions
/// come at once.
const FIRST_PART: usize = 1_000;
/// Places per later part (one script call each).
const PART: usize = 10_000;
/// Early joiners read from Redis per page.
const READ_PAGE: isize = 2_000;
/// Places recorded in MySQL per transaction, and rows per insert.
const RECORD_BATCH: usize = 5_000;
const INSERT_ROWS: usize = 1_000;

/// The draw's lease key, beside the room's keys.
pub(super) fn lease_key(keys: &RoomKeys) -> String {
    let base = keys.meta.strip_suffix(":meta").unwrap_or(&keys.meta);
    format!("{base}:draw-lease")
}

/// The draw as MySQL holds it.
#[derive(Debug, Clone)]
pub(super) struct Header {
    pub seed: u64,
    pub digest: Option<String>,
    pub recorded: usize,
}

/// How long each step of a draw took, for the logs and the measurements.
#[derive(Debug, Default, Clone)]
pub struct DrawTimes {
    pub joined: usize,
    pub read: Duration,
    pub first_places: Duration,
    pub all_places: Duration,
    pub recorded: Duration,
}

impl WaitingRoom {
    /// Starts this instance's draw of `a` unless it runs one already; it takes
    /// the lease or ends at once.
    pub(super) fn spawn_draw(self: &Arc<Self>, a: Arc<Activity>, shutdown: CancellationToken) {
        {
            let mut running = self.drawing.lock().unwrap_or_else(|e| e.into_inner());
            if !running.insert(a.id.clone()) {
                return;
            }
        }
        let room = self.clone();
        tokio::spawn(async move {
            let token = uuid::Uuid::new_v4().to_string();
            tokio::select! {
                _ = shutdown.cancelled() => {}
                outcome = room.draw(&a, &token) => {
                    if let Err(err) = outcome {
                        tracing::warn!(activity_id = %a.id, error = %format!("{err:#}"), "the waiting room's draw stopped; it goes on at the next step");
                    }
                }
            }
            // Let it go, so the next step (here or elsewhere) continues at once.
            let lease = lease_key(&RoomKeys::new(&a.id, a.stock_shards));
            let _ = room.hold_lease(&lease, &token, "release").await;
            room.drawing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&a.id);
        });
    }

    /// Runs (or continues) the draw of `a` while holding its lease. `None` when
    /// another instance holds it, or the draw is not due yet.
    pub async fn draw(&self, a: &Activity, token: &str) -> anyhow::Result<Option<DrawTimes>> {
        let started = Instant::now();
        let keys = RoomKeys::new(&a.id, a.stock_shards);
        let lease = lease_key(&keys);
        if !self.hold_lease(&lease, token, "take").await? {
            return Ok(None);
        }
        let mut conn = self.conn.clone();
        let (seed, recorded_flag): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(&keys.meta)
            .arg("seed")
            .arg("recorded")
            .query_async(&mut conn)
            .await
            .context("reading the draw's state")?;
        if seed.is_some() && recorded_flag.is_some() {
            return Ok(None);
        }
        if seed.is_none() {
            let highest = self.restore_if_lost(a, &keys).await?;
            let due = a.starts_at + chrono::Duration::from_std(DRAW_GRACE).unwrap_or_default();
            let sealed = self
                .run(a, &self.seal, &[arg(ms(due)), arg(highest)])
                .await
                .context("sealing the early joins")?;
            if Sealed::decode(sealed) == Sealed::Early {
                return Ok(None);
            }
        }
        let mut times = DrawTimes::default();
        let input = self.read_early_joiners(&keys).await?;
        times.joined = input.len();
        times.read = started.elapsed();
        if !self.hold_lease(&lease, token, "renew").await? {
            return Ok(None);
        }
        // Hashing and shuffling a million joiners takes a while: off the
        // runtime's workers, so the admissions and polls go on meanwhile.
        let (input, fingerprint) = tokio::task::spawn_blocking(move || {
            let fingerprint = digest(&input);
            (input, fingerprint)
        })
        .await
        .context("the joiners' digest")?;
        let header = claim_draw(
            &self.pool,
            &a.id,
            new_seed(),
            input.len(),
            &fingerprint,
            token,
        )
        .await?;
        if header.digest.as_deref().is_some_and(|d| d != fingerprint) {
            tracing::error!(activity_id = %a.id, "the early joiners Redis holds differ from those drawn (a room rebuilt without some joins): the recorded places stand, the others follow in drawn order");
        }
        let prefix = load_entries(&self.pool, &a.id, header.recorded).await?;
        let seed = header.seed;
        let order = tokio::task::spawn_blocking(move || continue_order(prefix, input, seed))
            .await
            .context("drawing the order")?;
        self.write_places(
            &keys,
            &lease,
            token,
            header.seed,
            &order,
            started,
            &mut times,
        )
        .await?;
        if !self
            .record_places(a, &lease, token, &order)
            .await
            .context("recording the draw")?
        {
            return Ok(None);
        }
        times.recorded = started.elapsed();
        let _: () = redis::cmd("HSET")
            .arg(&keys.meta)
            .arg("recorded")
            .arg("1")
            .query_async(&mut conn)
            .await
            .context("marking the draw recorded")?;
        tracing::info!(activity_id = %a.id, seed = header.seed, joined = order.len(), ?times, "waiting room drawn and recorded");
        Ok(Some(times))
    }

    /// Takes (`take`), renews (`renew`) or lets go of (`release`) the draw's
    /// lease.
    async fn hold_lease(&self, lease: &str, token: &str, how: &str) -> anyhow::Result<bool> {
        let held: i64 = crate::stock::invoke(
            &self.conn,
            &self.lease,
            &[lease],
            &[arg(token), arg(DRAW_LEASE.as_millis() as u64), arg(how)],
        )
        .await
        .context("the draw's lease")?;
        Ok(held == 1)
    }

    /// A room Redis lost (MySQL knows more joiners, a higher arrival number, or
    /// a draw): its joiners and settled turns back from MySQL before it is
    /// sealed. The highest arrival number MySQL knows (0 when nothing was lost).
    async fn restore_if_lost(&self, a: &Activity, keys: &RoomKeys) -> anyhow::Result<u64> {
        let (count, highest): (i64, u64) = sqlx::query_as(
            "SELECT COUNT(*), CAST(COALESCE(MAX(joined_seq), 0) AS UNSIGNED) \
             FROM waiting_room_journal WHERE activity_id = ? AND kind IN ('early', 'late')",
        )
        .bind(&a.id)
        .fetch_one(&self.pool)
        .await
        .context("counting the recorded joins")?;
        let drawn: Option<u64> =
            sqlx::query_scalar("SELECT seed FROM waiting_room_draws WHERE activity_id = ?")
                .bind(&a.id)
                .fetch_optional(&self.pool)
                .await
                .context("reading the draw")?;
        let mut conn = self.conn.clone();
        let (early, late, seq): (i64, i64, Option<u64>) = redis::pipe()
            .zcard(&keys.joined)
            .zcard(&keys.late)
            .get(&keys.seq)
            .query_async(&mut conn)
            .await
            .context("counting the joins in Redis")?;
        if drawn.is_none() && count <= early + late && highest <= seq.unwrap_or(0) {
            return Ok(0);
        }
        let restored: Vec<JournalRow> = load_journal(&self.pool, &a.id).await?;
        let entries_highest: u64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(MAX(joined_seq), 0) AS UNSIGNED) FROM waiting_room_entries \
             WHERE activity_id = ?",
        )
        .bind(&a.id)
        .fetch_one(&self.pool)
        .await
        .context("reading the drawn arrival numbers")?;
        self.restore_journal(a, &restored).await?;
        Ok(highest.max(entries_highest))
    }

    /// The sealed early joiners in arrival order, a page at a time.
    async fn read_early_joiners(&self, keys: &RoomKeys) -> anyhow::Result<Vec<(String, u64)>> {
        let mut conn = self.conn.clone();
        let mut joined = Vec::new();
        let mut start = 0isize;
        loop {
            let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(&keys.joined)
                .arg(start)
                .arg(start + READ_PAGE - 1)
                .arg("WITHSCORES")
                .query_async(&mut conn)
                .await
                .context("reading the early joiners")?;
            let n = page.len();
            joined.extend(page.into_iter().map(|(u, s)| (u, s as u64)));
            if n < READ_PAGE as usize {
                return Ok(joined);
            }
            start += READ_PAGE;
        }
    }

    /// Writes the order's places to Redis from where they stand, a first small
    /// part then larger ones.
    #[allow(clippy::too_many_arguments)]
    async fn write_places(
        &self,
        keys: &RoomKeys,
        lease: &str,
        token: &str,
        seed: u64,
        order: &[(String, u64)],
        started: Instant,
        times: &mut DrawTimes,
    ) -> anyhow::Result<()> {
        let mut conn = self.conn.clone();
        let written: Option<usize> = redis::cmd("HGET")
            .arg(&keys.meta)
            .arg("written")
            .query_async(&mut conn)
            .await
            .context("reading the places written")?;
        let mut written = written.unwrap_or(0);
        let mut all_keys: Vec<&str> = keys.all().to_vec();
        all_keys.push(lease);
        loop {
            let part = if written == 0 { FIRST_PART } else { PART };
            let from = written.min(order.len());
            let end = (from + part).min(order.len());
            let mut args = Vec::with_capacity(6 + 2 * (end - from));
            args.extend([
                arg(seed),
                arg(order.len()),
                arg(from),
                arg(LATE_PLACES),
                arg(token),
                arg(DRAW_LEASE.as_millis() as u64),
            ]);
            for (user, seq) in &order[from..end] {
                args.push(arg(user));
                args.push(arg(seq));
            }
            let now: i64 = crate::stock::invoke(&self.conn, &self.draw, &all_keys, &args)
                .await
                .context("writing the drawn places")?;
            match now {
                -1 => anyhow::bail!("the room was lost while its places were written"),
                -2 => anyhow::bail!("another seed is written for this room"),
                -3 => anyhow::bail!("the draw's lease was lost"),
                _ => {}
            }
            let now = usize::try_from(now).unwrap_or(0);
            if times.first_places.is_zero() {
                times.first_places = started.elapsed();
            }
            if now >= order.len() {
                times.all_places = started.elapsed();
                return Ok(());
            }
            if now <= from && end > from {
                anyhow::bail!("the drawn places did not move on from {written}");
            }
            written = now;
        }
    }

    /// Records the order's places in MySQL in batches, from MySQL's count on,
    /// while this instance is the recorder. `false` when another took over.
    async fn record_places(
        &self,
        a: &Activity,
        lease: &str,
        token: &str,
        order: &[(String, u64)],
    ) -> anyhow::Result<bool> {
        loop {
            let mut tx = self.pool.begin().await?;
            let (recorded, recorder): (u32, Option<String>) = sqlx::query_as(
                "SELECT recorded, recorder FROM waiting_room_draws WHERE activity_id = ? FOR UPDATE",
            )
            .bind(&a.id)
            .fetch_one(&mut *tx)
            .await?;
            if recorder.as_deref() != Some(token) {
                return Ok(false);
            }
            let from = recorded as usize;
            if from >= order.len() {
                sqlx::query(
                    "UPDATE waiting_room_draws SET recorded_at = COALESCE(recorded_at, ?) \
                     WHERE activity_id = ?",
                )
                .bind(Utc::now().naive_utc())
                .bind(&a.id)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                return Ok(true);
            }
            let to = (from + RECORD_BATCH).min(order.len());
            for start in (from..to).step_by(INSERT_ROWS) {
                let end = (start + INSERT_ROWS).min(to);
                let mut q = sqlx::QueryBuilder::new(
                    "INSERT INTO waiting_room_entries (activity_id, position, user_id, joined_seq) ",
                );
                q.push_values(
                    order[start..end].iter().enumerate(),
                    |mut b, (i, (user, seq))| {
                        b.push_bind(&a.id)
                            .push_bind((start + i + 1) as u32)
                            .push_bind(user)
                            .push_bind(*seq);
                    },
                );
                q.build().execute(&mut *tx).await?;
            }
            let done = (to == order.len()).then(|| Utc::now().naive_utc());
            sqlx::query(
                "UPDATE waiting_room_draws SET recorded = ?, recorded_at = ? WHERE activity_id = ?",
            )
            .bind(to as u32)
            .bind(done)
            .bind(&a.id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            if !self.hold_lease(lease, token, "renew").await? {
                return Ok(false);
            }
        }
    }
}

/// A digest of the draw's input, the early joiners in arrival order (64-bit
/// FNV-1a over `arrival\tuser\n` lines, in hex): an auditor checks the recorded
/// arrival order against it, and an instance continuing a draw checks that it
/// draws from the same joiners.
pub fn digest(joined: &[(String, u64)]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (user, seq) in joined {
        for b in seq
            .to_string()
            .bytes()
            .chain([b'\t'])
            .chain(user.bytes())
            .chain([b'\n'])
        {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// The order of a draw: the places recorded already (`prefix`, which stand
/// whatever happens), then everyone else of `joined` (in arrival order) in the
/// order the draw from `seed` gives them. Drawing from the same joiners, it is
/// exactly [`draw_order`] of them, the prefix being its beginning.
pub fn continue_order(
    prefix: Vec<(String, u64)>,
    mut joined: Vec<(String, u64)>,
    seed: u64,
) -> Vec<(String, u64)> {
    shuffle(&mut joined, seed);
    if prefix.is_empty() {
        return joined;
    }
    let placed: HashSet<&str> = prefix.iter().map(|(u, _)| u.as_str()).collect();
    let rest: Vec<(String, u64)> = joined
        .into_iter()
        .filter(|(u, _)| !placed.contains(u.as_str()))
        .collect();
    let mut order = prefix;
    order.extend(rest);
    order
}

/// Records the draw's header unless one is recorded, and makes `token` its
/// recorder: a recorder taken over records nothing more. The header as it
/// stands.
async fn claim_draw(
    pool: &MySqlPool,
    activity_id: &str,
    seed: u64,
    joined: usize,
    digest: &str,
    token: &str,
) -> anyhow::Result<Header> {
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(
        "INSERT IGNORE INTO waiting_room_draws \
         (activity_id, seed, joined, digest, recorded, drawn_at, recorder) \
         VALUES (?, ?, ?, ?, 0, ?, ?)",
    )
    .bind(activity_id)
    .bind(seed)
    .bind(u32::try_from(joined).context("too many joined")?)
    .bind(digest)
    .bind(Utc::now().naive_utc())
    .bind(token)
    .execute(&mut *tx)
    .await
    .context("recording the draw")?;
    if inserted.rows_affected() == 0 {
        sqlx::query("UPDATE waiting_room_draws SET recorder = ? WHERE activity_id = ?")
            .bind(token)
            .bind(activity_id)
            .execute(&mut *tx)
            .await
            .context("taking over the draw's recording")?;
    } else {
        tracing::info!(%activity_id, seed, joined, "waiting room drawn");
    }
    let (seed, digest, recorded): (u64, Option<String>, u32) = sqlx::query_as(
        "SELECT seed, digest, recorded FROM waiting_room_draws WHERE activity_id = ?",
    )
    .bind(activity_id)
    .fetch_one(&mut *tx)
    .await
    .context("reading the draw")?;
    tx.commit().await?;
    Ok(Header {
        seed,
        digest,
        recorded: recorded as usize,
    })
}

/// The first `n` recorded places, in order.
async fn load_entries(
    pool: &MySqlPool,
    activity_id: &str,
    n: usize,
) -> anyhow::Result<Vec<(String, u64)>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "SELECT user_id, joined_seq FROM waiting_room_entries \
         WHERE activity_id = ? AND position <= ? ORDER BY position",
    )
    .bind(activity_id)
    .bind(n as u64)
    .fetch_all(pool)
    .await
    .context("reading the recorded places")
}

/// A random seed below 2^53, so a metrics gauge shows it exactly.
fn new_seed() -> u64 {
    (uuid::Uuid::new_v4().as_u128() as u64) & ((1 << 53) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::waiting_room::draw_order;
    use std::collections::HashMap;

    /// The users in `order` by their place: user → place (1 first).
    fn places_of(order: &[(String, u64)]) -> HashMap<&str, usize> {
        order
            .iter()
            .enumerate()
            .map(|(i, (u, _))| (u.as_str(), i + 1))
            .collect()
    }

    fn joiners(n: usize) -> Vec<(String, u64)> {
        (0..n).map(|i| (format!("u{i}"), i as u64 + 1)).collect()
    }

    #[test]
    fn a_draw_continued_from_its_recorded_places_is_the_same_draw() {
        let joined = joiners(5_000);
        let users: Vec<String> = joined.iter().map(|(u, _)| u.clone()).collect();
        let whole = continue_order(Vec::new(), joined.clone(), 9);
        let names: Vec<String> = whole.iter().map(|(u, _)| u.clone()).collect();
        assert_eq!(names, draw_order(&users, 9));
        for cut in [1, 1_000, 4_999, 5_000] {
            let prefix = whole[..cut].to_vec();
            assert_eq!(continue_order(prefix, joined.clone(), 9), whole, "{cut}");
        }
        // Joiners missing (a rebuilt room): the recorded places stand, everyone
        // known is placed once.
        let partial: Vec<(String, u64)> = joined[100..].to_vec();
        let order = continue_order(whole[..50].to_vec(), partial, 9);
        assert_eq!(&order[..50], &whole[..50]);
        let places = places_of(&order);
        assert_eq!(places.len(), order.len());
        assert!(joined[100..]
            .iter()
            .all(|(u, _)| places.contains_key(u.as_str())));
    }

    #[test]
    fn the_digest_follows_the_arrival_order() {
        let a = joiners(3);
        let mut b = a.clone();
        b.swap(0, 1);
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_ne!(digest(&a), digest(&b));
        assert_eq!(digest(&[]).len(), 16);
    }
}
