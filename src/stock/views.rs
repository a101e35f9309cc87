//! Reservation-status polls that spare MySQL (`GET /flash/{sku}/reservation`).
//!
//! A crowd of winners polls its reservation every second while it is pending,
//! and again on every page load. A pending reservation is answered from Redis
//! alone. Once it is an order, the first poll reads MySQL and caches the view in
//! Redis (`view_fill.lua`), on the user's home shard, where every instance finds
//! it; later polls are answered from that copy (`view_read.lua`) until the order
//! changes. Whoever changes an order (a payment, a cancellation) moves the
//! user's version around the change (`view_change.lua`): odd while it is under
//! way, even again once committed. A copy is cached only under the even version
//! and the build it was read under, so a view read before a change is never
//! served after it, and a change whose end never came leaves the user's polls
//! on MySQL, never on a stale copy.

use redis::RedisResult;

use super::barrier::Replication;
use super::keys::{home_shard, Keys};
use super::script::arg;
use super::store::StockStore;

/// What Redis could answer of a poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Polled {
    /// The reservation waits for MySQL.
    Pending { reservation_id: String },
    /// The order's view, as cached, unchanged since; and the token a fill must
    /// present, should the caller find the copy too old to serve.
    Cached { view: String, token: String },
    /// MySQL must be asked: the reservation id Redis holds for the user, if any,
    /// and the token a fill must present (`None`: the state is not loaded, and
    /// nothing is cached).
    Miss {
        reservation_id: Option<String>,
        token: Option<String>,
    },
}

/// The two halves of a change to a user's order (see `view_change.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewChange {
    /// Before MySQL is changed: nothing is cached until `End`.
    Begin,
    /// Once MySQL's change is committed.
    End,
}

impl StockStore {
    /// One round trip: the user's pending reservation, or the cached view of
    /// their order.
    pub async fn poll_view(
        &self,
        activity_id: &str,
        shards: u8,
        user_id: &str,
    ) -> RedisResult<Polled> {
        let k = Keys::shard(activity_id, shards, home_shard(user_id, shards));
        let (kind, value, token): (String, String, String) = self
            .run(
                &self.view_read,
                &[&k.stock, &k.buyers, &k.pending, &k.views, &k.epoch],
                &[arg(user_id)],
            )
            .await?;
        Ok(decode_poll(&kind, value, token))
    }

    /// Caches the view of the user's order read from MySQL, if nothing changed
    /// since `token` was read. Returns whether it was cached.
    pub async fn fill_view(
        &self,
        activity_id: &str,
        shards: u8,
        user_id: &str,
        token: &str,
        view: &str,
    ) -> RedisResult<bool> {
        let k = Keys::shard(activity_id, shards, home_shard(user_id, shards));
        let cached: i64 = self
            .run(
                &self.view_fill,
                &[&k.stock, &k.views, &k.epoch],
                &[arg(user_id), arg(token), arg(view)],
            )
            .await?;
        Ok(cached == 1)
    }

    /// Marks a change of the user's order, on the shard of its reservation
    /// (the user's home shard). `Begin` waits, where replicas are required
    /// (`redis.min_replicas_acked`), until they hold the mark: a failover to a
    /// replica that missed it could serve a view cached before the change.
    /// Returns `false` only when that wait failed.
    pub async fn view_change(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        phase: ViewChange,
    ) -> RedisResult<bool> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        let phase = match phase {
            ViewChange::Begin => "begin",
            ViewChange::End => "end",
        };
        let version: i64 = self
            .run(
                &self.view_change,
                &[&k.stock, &k.views],
                &[arg(user_id), arg(phase)],
            )
            .await?;
        // Not loaded: nothing is cached there, nothing to wait for.
        if phase != "begin" || version < 0 {
            return Ok(true);
        }
        Ok(self
            .replicated(activity_id, user_id, reservation_id)
            .await?
            != Replication::Missing)
    }
}

/// `view_read.lua`'s answer.
fn decode_poll(kind: &str, value: String, token: String) -> Polled {
    match kind {
        "pending" => Polled::Pending {
            reservation_id: value,
        },
        "view" => Polled::Cached { view: value, token },
        _ => Polled::Miss {
            reservation_id: (!value.is_empty()).then_some(value),
            token: (!token.is_empty()).then_some(token),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_s_answers_are_read_as_they_are_meant() {
        assert_eq!(
            decode_poll("pending", "r1".into(), String::new()),
            Polled::Pending {
                reservation_id: "r1".into()
            }
        );
        assert_eq!(
            decode_poll("view", "{}".into(), "3|2".into()),
            Polled::Cached {
                view: "{}".into(),
                token: "3|2".into()
            }
        );
        assert_eq!(
            decode_poll("miss", String::new(), String::new()),
            Polled::Miss {
                reservation_id: None,
                token: None
            }
        );
        assert_eq!(
            decode_poll("miss", "r1".into(), "3|0".into()),
            Polled::Miss {
                reservation_id: Some("r1".into()),
                token: Some("3|0".into())
            }
        );
    }
}
