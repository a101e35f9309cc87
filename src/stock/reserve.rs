//! Reserving: the home shard first, then, for a split sale, units borrowed from
//! its siblings (`reserve.lua`, `lend.lua`).

use redis::RedisResult;

use super::{arg, shard_of, Keys, StockStore};

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
enum ShardReserve {
    Done(ReserveOutcome),
    /// Fewer units left on this shard than asked for; its restock count then.
    Dry {
        left: i64,
        restock: i64,
    },
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
            let (lent, epoch, restock): (i64, String, i64) = self
                .run(
                    &self.lend,
                    &[&lender.stock, &lender.lent, &lender.epoch, &lender.restock],
                    &[arg(&transfer), arg(need), arg(home.shard), arg(now_ms)],
                )
                .await?;
            self.dry.mark(&lender.stock, (lent == 0).then_some(restock));
            match lent {
                -3 => return Ok(ReserveOutcome::NotLoaded),
                0 => {
                    empty.push((lender.restock.clone(), restock));
                    continue;
                }
                _ => {}
            }
            metrics::counter!("flashsale_stock_shard_transfers_total").increment(1);
            left = match reserve(Some((transfer, lent, epoch))).await? {
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
        if quantity == 1
            && empty.len() == usize::from(shards)
            && self.gate.begin_closing(activity_id)
        {
            let store = self.clone();
            let activity_id = activity_id.to_owned();
            tokio::spawn(async move {
                let (found, too_large) = match store.read_buyers(&activity_id, shards, empty).await
                {
                    Ok(read) => read,
                    Err(err) => {
                        tracing::debug!(%activity_id, error = %err, "the sold-out gate stays open");
                        (None, false)
                    }
                };
                store.gate.end_closing(&activity_id, found, too_large);
            });
        }
        Ok(ReserveOutcome::SoldOut)
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
        let (code, value, restock): (i64, String, i64) = self
            .run(&self.reserve, &k.reserve_script_keys(), &args)
            .await?;
        Ok(ShardReserve::Done(match code {
            1 => ReserveOutcome::Reserved {
                reservation_id: value,
            },
            0 => ReserveOutcome::AlreadyReserved {
                reservation_id: value,
            },
            -1 => {
                return Ok(ShardReserve::Dry {
                    left: value.parse().unwrap_or(0),
                    restock,
                })
            }
            -4 => ReserveOutcome::Paused,
            _ => ReserveOutcome::NotLoaded,
        }))
    }
}
