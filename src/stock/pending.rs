//! Reservations pending in Redis until MySQL decides them: their fate
//! (acknowledged or being withdrawn), the orders MySQL confirmed, and the
//! reservations left pending too long.

use redis::{AsyncCommands, RedisResult};

use super::keys::Keys;
use super::script::arg;
use super::store::StockStore;

/// Where a pending reservation stands (see `fate.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Reserved; its message may or may not be in the queue.
    Pending,
    /// Its message is in the queue and a `202` was (or is being) answered.
    Acknowledged,
    /// Being withdrawn: no `202` may be answered; MySQL decides.
    Withdrawing,
}

impl Fate {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "p" => Fate::Pending,
            "a" => Fate::Acknowledged,
            "w" => Fate::Withdrawing,
            _ => return None,
        })
    }
}

/// What moving a reservation to a fate did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FateChange {
    /// Done, or it was in that fate already.
    Done,
    /// It is in the other fate already (acknowledged vs withdrawing).
    Refused,
    /// No such pending reservation: decided already, or Redis lost it.
    Unknown,
}

impl FateChange {
    /// `fate.lua`'s 1 done, 0 refused, -1 unknown.
    fn decode(n: i64) -> Self {
        match n {
            1 => FateChange::Done,
            0 => FateChange::Refused,
            _ => FateChange::Unknown,
        }
    }
}

/// A reservation pending in Redis: not yet confirmed by MySQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReservation {
    pub reservation_id: String,
    pub user_id: String,
    pub units: u32,
    pub fate: Fate,
}

/// A reservation's details: "user|units|fate", read from the right: a user id
/// may hold `|` itself (`auth0|…`).
/// Details written before fates existed ("user|units") read as pending.
fn parse_detail(d: &str) -> Option<(String, u32, Fate)> {
    let (rest, fate) = match d.rsplit_once('|') {
        Some((rest, f)) if f.parse::<u32>().is_err() => (rest, Fate::parse(f)?),
        _ => (d, Fate::Pending),
    };
    let (user, units) = rest.rsplit_once('|')?;
    Some((user.to_owned(), units.parse::<u32>().ok()?, fate))
}

/// Groups items by the shard of the reservation id `rid` reads from each, in
/// the order the shards first appear.
fn by_shard<'a, T>(
    activity_id: &str,
    items: &'a [T],
    rid: impl Fn(&'a T) -> &'a String,
) -> Vec<(Keys, Vec<&'a T>)> {
    let mut groups: Vec<(Keys, Vec<&'a T>)> = Vec::new();
    for item in items {
        let k = Keys::of_reservation(activity_id, rid(item));
        match groups.iter_mut().find(|(g, _)| g.stock == k.stock) {
            Some((_, group)) => group.push(item),
            None => groups.push((k, vec![item])),
        }
    }
    groups
}

impl StockStore {
    /// Clears the pending marks of orders MySQL now holds (reservation id, user id,
    /// units), so the reconciler sees only reservations still undecided, and adopts
    /// the orders this Redis state does not know (see `confirm.lua`). Returns how
    /// many were adopted: more than 0 means Redis had lost reservations.
    pub async fn confirm(
        &self,
        activity_id: &str,
        orders: &[(String, String, u32)],
    ) -> RedisResult<u64> {
        let mut adopted = 0;
        for (k, orders) in by_shard(activity_id, orders, |o| &o.0) {
            let mut args = Vec::with_capacity(orders.len() * 3);
            for (reservation, user, units) in orders {
                args.extend([arg(reservation), arg(user), arg(*units)]);
            }
            let n: u64 = self
                .run(
                    &self.confirm,
                    &[
                        &k.stock, &k.buyers, &k.pending, &k.res, &k.filter, &k.restock,
                    ],
                    &args,
                )
                .await?;
            adopted += n;
        }
        Ok(adopted)
    }

    /// Drops pending marks without touching stock, buyers or refunds: for
    /// reservations MySQL decided as failed already (the reconciler's drift repair
    /// settles their units against MySQL's count).
    pub async fn release(&self, activity_id: &str, reservation_ids: &[String]) -> RedisResult<()> {
        for (k, ids) in by_shard(activity_id, reservation_ids, |r| r) {
            let mut conn = self.conn.clone();
            let _: () = redis::pipe()
                .zrem(&k.pending, &ids)
                .ignore()
                .hdel(&k.res, &ids)
                .ignore()
                .query_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    /// Moves a pending reservation to `Acknowledged` (`ack = true`: a `202` is about
    /// to be answered) or `Withdrawing`; exactly one of the two can ever succeed.
    pub async fn set_fate(
        &self,
        activity_id: &str,
        reservation_id: &str,
        ack: bool,
    ) -> RedisResult<FateChange> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        let n = self
            .run(
                &self.fate,
                &[&k.res],
                &[
                    arg(reservation_id),
                    arg(if ack { "ack" } else { "withdraw" }),
                ],
            )
            .await?;
        Ok(FateChange::decode(n))
    }

    /// Pending reservations older than `before_ms`, oldest first on each shard
    /// (at most `limit` a shard). Reservations whose details are gone are dropped
    /// from the set.
    pub async fn expired_pending(
        &self,
        activity_id: &str,
        shards: u8,
        before_ms: i64,
        limit: usize,
    ) -> RedisResult<Vec<PendingReservation>> {
        let mut out = Vec::new();
        for k in Keys::all(activity_id, shards) {
            let mut conn = self.conn.clone();
            let ids: Vec<String> = redis::cmd("ZRANGEBYSCORE")
                .arg(&k.pending)
                .arg("-inf")
                .arg(before_ms)
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(&mut conn)
                .await?;
            if ids.is_empty() {
                continue;
            }
            let details: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(&k.res)
                .arg(&ids)
                .query_async(&mut conn)
                .await?;
            let mut junk = Vec::new();
            for (id, detail) in ids.into_iter().zip(details) {
                match detail.as_deref().and_then(parse_detail) {
                    Some((user_id, units, fate)) => out.push(PendingReservation {
                        reservation_id: id,
                        user_id,
                        units,
                        fate,
                    }),
                    None => junk.push(id),
                }
            }
            if !junk.is_empty() {
                let _: () = conn.zrem(&k.pending, &junk).await?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fate_replies_decode() {
        assert_eq!(
            [1, 0, -1].map(FateChange::decode),
            [FateChange::Done, FateChange::Refused, FateChange::Unknown]
        );
    }

    #[test]
    fn reservation_details() {
        assert_eq!(
            parse_detail("alice|2|a"),
            Some(("alice".into(), 2, Fate::Acknowledged))
        );
        assert_eq!(
            parse_detail("bob-1|1|w"),
            Some(("bob-1".into(), 1, Fate::Withdrawing))
        );
        // Written before fates existed.
        assert_eq!(
            parse_detail("carol|3"),
            Some(("carol".into(), 3, Fate::Pending))
        );
        // Identity providers' ids hold `|` themselves.
        assert_eq!(
            parse_detail("auth0|5f7c|1|p"),
            Some(("auth0|5f7c".into(), 1, Fate::Pending))
        );
        assert_eq!(
            parse_detail("a|2|b|3|a"),
            Some(("a|2|b".into(), 3, Fate::Acknowledged))
        );
        assert_eq!(parse_detail("dave|x|p"), None);
        assert_eq!(parse_detail("erin|1|z"), None);
        assert_eq!(parse_detail("nobody"), None);
    }
}
