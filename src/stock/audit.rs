//! The audit: Redis's units against what MySQL implies, and the repair of a
//! drift (`audit.lua`).

use redis::RedisResult;

use super::keys::{shard_of, Keys};
use super::script::arg;
use super::store::StockStore;

/// What `audit.lua` found, summed over the activity's shards.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Audit {
    pub loaded: bool,
    pub stock: i64,
    pub pending_units: i64,
    pub owed_units: i64,
    pub expected: i64,
    pub repaired: bool,
    /// Units lent between shards and not yet received (split activities).
    pub in_transit: i64,
    /// Each shard's figures, as read (one entry when the activity is not split).
    #[serde(skip)]
    #[schema(ignore)]
    pub parts: Vec<ShardAudit>,
}

/// One shard's figures in an audit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardAudit {
    pub loaded: bool,
    pub stock: i64,
    pub pending_units: i64,
    pub owed_units: i64,
    pub lent: i64,
    pub received: i64,
}

impl ShardAudit {
    /// `audit.lua`'s `{loaded (0/1), stock, pending units, owed units, expected,
    /// repaired (0/1), units lent, units received}`. A repair that was not made
    /// reads as a shard that changed meanwhile: not loaded.
    fn decode(reply: &[i64], repairing: bool) -> Self {
        let at = |i: usize| reply.get(i).copied().unwrap_or_default();
        ShardAudit {
            loaded: at(0) == 1 && !(repairing && at(5) != 1),
            stock: at(1),
            pending_units: at(2),
            owed_units: at(3),
            lent: at(6),
            received: at(7),
        }
    }

    /// The units this shard accounts for: no transfer between shards changes it.
    pub(super) fn holds(&self) -> i64 {
        self.stock + self.pending_units + self.owed_units + self.lent - self.received
    }
}

/// The owed reservations (id, units) that live on shard `k`.
pub(super) fn owed_on(owed: &[(String, u32)], k: u8) -> Vec<(String, u32)> {
    owed.iter()
        .filter(|(r, _)| shard_of(r).0 == k)
        .cloned()
        .collect()
}

impl StockStore {
    pub(super) async fn audit_shard(
        &self,
        k: &Keys,
        expected_total: i64,
        owed: &[(String, u32)],
        repair: Option<&ShardAudit>,
    ) -> RedisResult<ShardAudit> {
        let mut args = vec![arg(expected_total), arg(0)];
        match repair {
            Some(seen) => args.extend([arg("repair"), arg(seen.stock), arg(seen.pending_units)]),
            None => args.extend([arg("read"), arg(0), arg(0)]),
        }
        for (reservation, units) in owed {
            args.push(arg(reservation));
            args.push(arg(*units));
        }
        let reply: Vec<i64> = self
            .run(
                &self.audit,
                &[
                    &k.stock,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.lent,
                    &k.received,
                    &k.restock,
                ],
                &args,
            )
            .await?;
        Ok(ShardAudit::decode(&reply, repair.is_some()))
    }

    /// Compares Redis's stock with what MySQL implies (see `audit.lua`): MySQL's
    /// `total` units minus `live_units` in live orders must all be in Redis, for
    /// sale, pending, owed back (`owed`: failed or cancelled orders' reservations
    /// and units) or between shards.
    pub async fn audit(
        &self,
        activity_id: &str,
        shards: u8,
        total: i64,
        live_units: i64,
        owed: &[(String, u32)],
    ) -> RedisResult<Audit> {
        let mut audit = Audit {
            loaded: true,
            ..Audit::default()
        };
        for k in Keys::all(activity_id, shards) {
            let owed = owed_on(owed, k.shard);
            let part = self.audit_shard(&k, 0, &owed, None).await?;
            audit.loaded &= part.loaded;
            audit.stock += part.stock;
            audit.pending_units += part.pending_units;
            audit.owed_units += part.owed_units;
            audit.in_transit += part.lent - part.received;
            audit.parts.push(part);
        }
        audit.expected =
            total - live_units - audit.pending_units - audit.owed_units - audit.in_transit;
        Ok(audit)
    }

    /// Sets the stock to what MySQL implies, given what `audit` read (`seen`):
    /// on one shard (the one with the most units when lowering), only if that
    /// shard still holds exactly what the read saw (compare-and-set). Returns the
    /// audit with `repaired` set.
    pub async fn repair(
        &self,
        activity_id: &str,
        shards: u8,
        total: i64,
        live_units: i64,
        owed: &[(String, u32)],
        seen: &Audit,
    ) -> RedisResult<Audit> {
        let mut done = seen.clone();
        let drift = seen.stock - seen.expected;
        let target = if drift > 0 {
            seen.parts
                .iter()
                .enumerate()
                .max_by_key(|(_, p)| p.stock)
                .map_or(0, |(i, _)| i)
        } else {
            0
        };
        let (Some(part), Ok(shard)) = (seen.parts.get(target), u8::try_from(target)) else {
            return Ok(done);
        };
        let others: i64 = seen
            .parts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != target)
            .map(|(_, p)| p.holds())
            .sum();
        let k = Keys::shard(activity_id, shards, shard);
        let owed = owed_on(owed, k.shard);
        let after = self
            .audit_shard(&k, total - live_units - others, &owed, Some(part))
            .await?;
        done.repaired = after.loaded;
        if done.repaired {
            self.gate.open(activity_id);
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_replies_decode() {
        let read = ShardAudit::decode(&[1, 5, 2, 1, 0, 0, 3, 4], false);
        assert_eq!(
            read,
            ShardAudit {
                loaded: true,
                stock: 5,
                pending_units: 2,
                owed_units: 1,
                lent: 3,
                received: 4
            }
        );
        assert!(ShardAudit::decode(&[1, 5, 2, 1, 0, 1, 3, 4], true).loaded);
        assert!(!ShardAudit::decode(&[1, 5, 2, 1, 0, 0, 3, 4], true).loaded);
        assert!(!ShardAudit::decode(&[0], false).loaded);
    }
}
