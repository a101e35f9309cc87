//! Reserving: the home shard first, then, for a split sale, units borrowed from
//! its siblings (`reserve.lua`, `lend.lua`).

use redis::RedisResult;

use super::keys::{shard_of, Keys};
use super::script::arg;
use super::store::StockStore;

/// What the reserve script decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Reserved {
        reservation_id: String,
    },
    AlreadyReserved {
        reservation_id: String,
    },
    SoldOut,
    /// A key is missing: the activity is not loaded (or Redis lost it).
    NotLoaded,
    Paused,
}

/// What `reserve.lua` answered on one shard.
#[derive(Debug, PartialEq, Eq)]
enum ShardReserve {
    Done(ReserveOutcome),
    /// Fewer units left on this shard than asked for; its restock count then.
    Dry {
        left: i64,
        restock: i64,
    },
}

impl ShardReserve {
    /// `{1, id}` reserved, `{0, id}` reserved before, `{-1, units left,
    /// restock}` too few units here, `{-4, ""}` paused; anything else (`-3`) not
    /// loaded.
    fn decode((code, value, restock): (i64, String, i64)) -> Self {
        ShardReserve::Done(match code {
            1 => ReserveOutcome::Reserved {
                reservation_id: value,
            },
            0 => ReserveOutcome::AlreadyReserved {
                reservation_id: value,
            },
            -1 => {
                return ShardReserve::Dry {
                    left: value.parse().unwrap_or(0),
                    restock,
                }
            }
            -4 => ReserveOutcome::Paused,
            _ => ReserveOutcome::NotLoaded,
        })
    }
}

/// What `lend.lua` answered.
#[derive(Debug, PartialEq, Eq)]
enum Lent {
    /// The lender is not loaded.
    NotLoaded,
    /// Nothing to lend; the lender's restock count then.
    Dry { restock: i64 },
    /// Units lent from the lender's build `epoch`.
    Units { units: i64, epoch: String },
}

impl Lent {
    /// `{units lent, epoch, restock}` (0 units: none to lend), or `{-3, ""}`
    /// when not loaded.
    fn decode((units, epoch, restock): (i64, String, i64)) -> Self {
        match units {
            -3 => Lent::NotLoaded,
            0 => Lent::Dry { restock },
            units => Lent::Units { units, epoch },
        }
    }
}

impl StockStore {
    /// Reserves `quantity` units for a user, under a reservation id from
    /// `new_reservation_id` (which names the user's home shard). On the home
    /// shard, one atomic step: already bought → enough stock → decrement → record
    /// the buyer and a pending reservation. A split activity's home shard that
    /// runs dry borrows what it lacks from its siblings in turn (`lend.lua`) and
    /// receives it in the same step as the reservation; sold out only when no
    /// shard has the units.
    pub async fn reserve(
        &self,
        activity_id: &str,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
    ) -> RedisResult<ReserveOutcome> {
        if self.sold_out_from_memory(activity_id, user_id) {
            return Ok(ReserveOutcome::SoldOut);
        }
        self.reserve_past_gate(activity_id, user_id, quantity, reservation_id, now_ms)
            .await
    }

    /// [`reserve`](Self::reserve) without asking the sold-out gate first: for a
    /// user the waiting room just admitted, whose turn may come from units that
    /// came back before this instance's gate has seen them.
    pub async fn reserve_past_gate(
        &self,
        activity_id: &str,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
    ) -> RedisResult<ReserveOutcome> {
        let home = Keys::of_reservation(activity_id, reservation_id);
        let (_, shards) = shard_of(reservation_id);
        let reserve = |transfer: Option<(String, i64, String)>| {
            self.reserve_on(&home, user_id, quantity, reservation_id, now_ms, transfer)
        };
        // Each shard's restock count as it was when found without the units.
        let mut empty = Vec::with_capacity(usize::from(shards));
        let mut left = match reserve(None).await? {
            ShardReserve::Done(outcome) => return Ok(outcome),
            ShardReserve::Dry { left, restock } => {
                empty.push((home.restock.clone(), restock));
                left
            }
        };
        for step in 1..shards {
            let lender = Keys::shard(activity_id, shards, (home.shard + step) % shards);
            if let Some(restock) = self.dry.recently(&lender.stock) {
                empty.push((lender.restock.clone(), restock));
                continue;
            }
            let transfer = format!("{reservation_id}>{}", lender.shard);
            let need = i64::from(quantity) - left;
            let (units, epoch) = match self
                .lend(&lender, &transfer, need, home.shard, now_ms)
                .await?
            {
                Lent::NotLoaded => return Ok(ReserveOutcome::NotLoaded),
                Lent::Dry { restock } => {
                    empty.push((lender.restock.clone(), restock));
                    continue;
                }
                Lent::Units { units, epoch } => (units, epoch),
            };
            metrics::counter!("flashsale_stock_shard_transfers_total").increment(1);
            left = match reserve(Some((transfer, units, epoch))).await? {
                ShardReserve::Done(outcome) => return Ok(outcome),
                ShardReserve::Dry { left, restock } => {
                    empty.retain(|(k, _)| *k != home.restock);
                    empty.push((home.restock.clone(), restock));
                    left
                }
            };
        }
        // Sold out for a single unit, every shard seen empty with its count (a
        // lender that just lent its last units left none): no request could be
        // served, so the sale is shut here until a count moves.
        if quantity == 1 && empty.len() == usize::from(shards) {
            self.shut_gate(activity_id, shards, empty);
        }
        Ok(ReserveOutcome::SoldOut)
    }

    /// Asks `lender` for `need` units for the transfer `transfer` to shard `to`
    /// (`lend.lua`), and remembers whether it had none.
    async fn lend(
        &self,
        lender: &Keys,
        transfer: &str,
        need: i64,
        to: u8,
        now_ms: i64,
    ) -> RedisResult<Lent> {
        let lent = Lent::decode(
            self.run(
                &self.lend,
                &[&lender.stock, &lender.lent, &lender.epoch, &lender.restock],
                &[arg(transfer), arg(need), arg(to), arg(now_ms)],
            )
            .await?,
        );
        let dry = match lent {
            Lent::Dry { restock } => Some(restock),
            _ => None,
        };
        self.dry.mark(&lender.stock, dry);
        Ok(lent)
    }

    async fn reserve_on(
        &self,
        k: &Keys,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
        transfer: Option<(String, i64, String)>,
    ) -> RedisResult<ShardReserve> {
        let mut args = vec![
            arg(user_id),
            arg(quantity),
            arg(reservation_id),
            arg(now_ms),
        ];
        if let Some((id, units, epoch)) = transfer {
            args.extend([arg(id), arg(units), arg(epoch)]);
        }
        let reply = self
            .run(&self.reserve, &k.reserve_script_keys(), &args)
            .await?;
        Ok(ShardReserve::decode(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_replies_decode() {
        let s = |v: &str| v.to_owned();
        let done = |o| ShardReserve::Done(o);
        assert_eq!(
            ShardReserve::decode((1, s("r1"), 0)),
            done(ReserveOutcome::Reserved {
                reservation_id: s("r1")
            })
        );
        assert_eq!(
            ShardReserve::decode((0, s("r0"), 0)),
            done(ReserveOutcome::AlreadyReserved {
                reservation_id: s("r0")
            })
        );
        assert_eq!(
            ShardReserve::decode((-1, s("2"), 5)),
            ShardReserve::Dry {
                left: 2,
                restock: 5
            }
        );
        assert_eq!(
            ShardReserve::decode((-4, s(""), 0)),
            done(ReserveOutcome::Paused)
        );
        assert_eq!(
            ShardReserve::decode((-3, s(""), 0)),
            done(ReserveOutcome::NotLoaded)
        );
    }

    #[test]
    fn lend_replies_decode() {
        let s = |v: &str| v.to_owned();
        assert_eq!(Lent::decode((-3, s(""), 0)), Lent::NotLoaded);
        assert_eq!(Lent::decode((0, s("4"), 9)), Lent::Dry { restock: 9 });
        assert_eq!(
            Lent::decode((2, s("4"), 9)),
            Lent::Units {
                units: 2,
                epoch: s("4")
            }
        );
    }
}
