//! Units going back: a reservation undone or whose order failed or lapsed, a
//! top-up, and the stock lowered to MySQL's count when MySQL refused one.

use redis::RedisResult;

use super::audit::owed_on;
use super::keys::{shard_of, Keys};
use super::script::arg;
use super::store::StockStore;

/// Which refund: see `refund.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundMode {
    /// The reservation never reached the queue: return it only if still pending,
    /// and give the purchase right back.
    Undo,
    /// The order failed or was cancelled: return the units, keep the right spent.
    Return,
    /// It lost to another order of the same user: return the units only if it is
    /// still pending here, keep the right spent.
    Drop,
}

/// What the refund script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundOutcome {
    Returned {
        units: u32,
    },
    AlreadyRefunded,
    NothingToUndo,
    /// `Undo` refused: the reservation was acknowledged (a `202` was answered).
    Acknowledged,
    NotLoaded,
}

impl StockStore {
    /// Returns a reservation's units exactly once (see `refund.lua` for the modes).
    pub async fn refund(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        quantity: u32,
        mode: RefundMode,
    ) -> RedisResult<RefundOutcome> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        self.refund_on(&k, activity_id, reservation_id, user_id, quantity, mode)
            .await
    }

    /// Adds a top-up's units to the activity's first shard, once: `key` joins the
    /// returned units (as a refund would), so a second call, or one after a rebuild
    /// that counted it, adds nothing. `NotLoaded`: the next build reads MySQL, which
    /// has the units already.
    pub async fn top_up(
        &self,
        activity_id: &str,
        shards: u8,
        key: &str,
        units: u32,
    ) -> RedisResult<RefundOutcome> {
        let k = Keys::shard(activity_id, shards, 0);
        self.refund_on(&k, activity_id, key, "", units, RefundMode::Return)
            .await
    }

    /// `refund.lua` on one shard. Units that came back through this instance open
    /// its sold-out gate at once (the other instances' within `SOLD_OUT_RECHECK`).
    async fn refund_on(
        &self,
        k: &Keys,
        activity_id: &str,
        id: &str,
        user_id: &str,
        quantity: u32,
        mode: RefundMode,
    ) -> RedisResult<RefundOutcome> {
        let mode = match mode {
            RefundMode::Undo => "undo",
            RefundMode::Return => "return",
            RefundMode::Drop => "drop",
        };
        let n: i64 = self
            .run(
                &self.refund,
                &[
                    &k.stock,
                    &k.buyers,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.restock,
                    &k.filter,
                ],
                &[arg(id), arg(user_id), arg(quantity), arg(mode)],
            )
            .await?;
        let outcome = RefundOutcome::decode(n);
        if matches!(outcome, RefundOutcome::Returned { .. }) {
            self.gate.open(activity_id);
        }
        Ok(outcome)
    }

    /// MySQL refused the reservation for lack of units: drops it and lowers the
    /// stock to what MySQL still has (`available`), never raising it. Returns the
    /// units the stock was lowered by (`None`: done before). `owed`: the units
    /// MySQL counts as available and Redis has yet to get back (reservation or
    /// top-up id, units; see `OrderRepo::owed_to_redis`), read after `available`;
    /// they are left room for, so their refunds do not lift Redis above MySQL.
    /// For a split activity the units its other shards account for are read
    /// first and left to them.
    pub async fn lower(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        available: i64,
        owed: &[(String, u32)],
    ) -> RedisResult<Option<i64>> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        let (_, shards) = shard_of(reservation_id);
        let mut others = 0;
        for sibling in Keys::all(activity_id, shards) {
            if sibling.shard != k.shard {
                let part = self
                    .audit_shard(&sibling, 0, &owed_on(owed, sibling.shard), None)
                    .await?;
                others += part.stock.max(0) + part.holds() - part.stock;
            }
        }
        let mut args = vec![
            arg(reservation_id),
            arg(user_id),
            arg(available),
            arg(others),
        ];
        for (id, units) in owed_on(owed, k.shard) {
            args.push(arg(id));
            args.push(arg(units));
        }
        let lowered = self
            .run(
                &self.lower,
                &[
                    &k.stock,
                    &k.buyers,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.lent,
                    &k.received,
                    &k.filter,
                ],
                &args,
            )
            .await?;
        Ok(decode_lowered(lowered))
    }
}

impl RefundOutcome {
    /// `refund.lua`'s units returned (> 0), or 0 already refunded, -1 nothing to
    /// undo, -2 acknowledged, -3 not loaded.
    fn decode(n: i64) -> Self {
        match n {
            0 => RefundOutcome::AlreadyRefunded,
            -1 => RefundOutcome::NothingToUndo,
            -2 => RefundOutcome::Acknowledged,
            -3 => RefundOutcome::NotLoaded,
            // The script returns the quantity it was given, which is at least 1.
            units => RefundOutcome::Returned {
                units: u32::try_from(units).unwrap_or(u32::MAX),
            },
        }
    }
}

/// `lower.lua`'s units the stock was lowered by, or -1 (`None`) done before.
fn decode_lowered(n: i64) -> Option<i64> {
    (n >= 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refund_replies_decode() {
        assert_eq!(
            [0, -1, -2, -3].map(RefundOutcome::decode),
            [
                RefundOutcome::AlreadyRefunded,
                RefundOutcome::NothingToUndo,
                RefundOutcome::Acknowledged,
                RefundOutcome::NotLoaded
            ]
        );
        assert_eq!(
            RefundOutcome::decode(3),
            RefundOutcome::Returned { units: 3 }
        );
        assert_eq!(decode_lowered(2), Some(2));
        assert_eq!(decode_lowered(0), Some(0));
        assert_eq!(decode_lowered(-1), None);
    }
}
