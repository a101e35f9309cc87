//! The reservation protocol, below HTTP: Redis → replicas → Kafka → fate →
//! replicas, and MySQL when the way back is unclear.
//!
//! 1. **Hold** the units and the user's right in Redis (`reserve.lua`, one atomic
//!    step). A script whose answer was lost may have run: its units are returned
//!    (a no-op if it did not).
//! 2. **Replicas** hold the reservation (`redis.min_replicas_acked`), so that until
//!    it is published, withdrawing it is a Redis matter alone.
//! 3. **Publish** its message to Kafka and wait for the broker. A message never
//!    sent is undone in Redis; one whose fate is unknown is withdrawn through
//!    MySQL, which decides between its order and its withdrawal once.
//! 4. **Acknowledge** it in Redis (its fate): from then on nobody may withdraw it.
//!    The replicas hold that too before the answer is a promise.
//!
//! A [`Reservations`] is built once at startup from the parts it uses; the
//! handler calls [`Reservations::reserve`] and maps the [`Outcome`] to a status.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tracing::Instrument;

use crate::activity::Activity;
use crate::kafka::{Publisher, ReservationMessage};
use crate::orders::{Decision, Incoming, OrderWriter};
use crate::stock::{
    new_reservation_id, FateChange, RefundMode, Replication, ReserveOutcome, StockStore,
};

/// How one reservation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Held, published and acknowledged: it will be an order.
    Reserved {
        reservation_id: String,
    },
    /// The user holds another reservation for this sale.
    AlreadyReserved {
        reservation_id: String,
    },
    SoldOut,
    Paused,
    /// A dependency failed; nothing is held for the client (what may still be
    /// in flight is decided without it).
    Unavailable(&'static str),
}

impl Outcome {
    /// A short name of the outcome, for traces.
    fn label(&self) -> &'static str {
        match self {
            Outcome::Reserved { .. } => "reserved",
            Outcome::AlreadyReserved { .. } => "already_reserved",
            Outcome::SoldOut => "sold_out",
            Outcome::Paused => "paused",
            Outcome::Unavailable(_) => "unavailable",
        }
    }
}

/// The span of one Redis script call on the reservation path (traces only),
/// named `redis.<script>`.
fn redis_span(name: &'static str, script: &'static str) -> tracing::Span {
    crate::detail_span!(
        "redis.script",
        otel.name = name,
        otel.kind = "client",
        db.system.name = "redis",
        script,
    )
}

/// A step that ends the reservation early gives the outcome to answer.
type Step<T> = Result<T, Outcome>;

/// The reservation protocol over its parts: the stock store, the producer, the
/// decision step, and the reconciler's wake-up.
#[derive(Clone)]
pub struct Reservations {
    stock: StockStore,
    publisher: Publisher,
    writer: OrderWriter,
    /// Wakes the reconciler at once (an activity missing in Redis).
    reconcile_now: Arc<Notify>,
}

impl Reservations {
    pub fn new(
        stock: StockStore,
        publisher: Publisher,
        writer: OrderWriter,
        reconcile_now: Arc<Notify>,
    ) -> Self {
        Reservations {
            stock,
            publisher,
            writer,
            reconcile_now,
        }
    }

    /// Reserves `quantity` units of `activity` for `user_id`. The sold-out gate
    /// was asked before (an open sale), or is passed by design (a user holding a
    /// waiting-room turn). Run it where a dropped request cannot stop it half-way.
    pub async fn reserve(
        &self,
        activity: &Activity,
        user_id: &str,
        quantity: u32,
        now: DateTime<Utc>,
    ) -> Outcome {
        // A trace's step (made only while traces are on); its children are the
        // Redis scripts and the publish whose context the message carries.
        let span = crate::detail_span!(
            "reserve",
            activity_id = %activity.id,
            quantity,
            outcome = tracing::field::Empty,
        );
        let outcome = match self
            .run(activity, user_id, quantity, now)
            .instrument(span.clone())
            .await
        {
            Ok(reservation_id) => Outcome::Reserved { reservation_id },
            Err(outcome) => outcome,
        };
        span.record("outcome", outcome.label());
        outcome
    }

    async fn run(
        &self,
        activity: &Activity,
        user_id: &str,
        quantity: u32,
        now: DateTime<Utc>,
    ) -> Step<String> {
        let reservation_id = self.hold(activity, user_id, quantity, now).await?;
        let incoming = Incoming {
            reservation_id: reservation_id.clone(),
            activity_id: activity.id.clone(),
            user_id: user_id.to_owned(),
            quantity,
        };
        // Replicas first hold the reservation itself: until it is published,
        // withdrawing it is a Redis matter alone, and the client holds nothing.
        if let Err(outcome) = self.replicated(&incoming, false).await {
            self.undo(&incoming).await;
            return Err(outcome);
        }
        let message = ReservationMessage {
            reservation_id: reservation_id.clone(),
            activity_id: activity.id.clone(),
            sku: activity.sku.clone(),
            user_id: user_id.to_owned(),
            quantity,
            reserved_at: now,
        };
        if !self.publish(&message, &incoming).await? {
            return self.withdraw(incoming).await;
        }
        self.acknowledge(incoming).await
    }

    /// Step 1: the units and the user's right, held in Redis.
    async fn hold(
        &self,
        activity: &Activity,
        user_id: &str,
        quantity: u32,
        now: DateTime<Utc>,
    ) -> Step<String> {
        let new_id = new_reservation_id(user_id, activity.stock_shards);
        let reserved = self
            .stock
            .reserve_past_gate(
                &activity.id,
                user_id,
                quantity,
                &new_id,
                now.timestamp_millis(),
            )
            .instrument(redis_span("redis.reserve", "reserve.lua"))
            .await;
        let outcome = match reserved {
            Ok(outcome) => outcome,
            Err(err) => {
                tracing::warn!(error = %err, activity_id = %activity.id, "reserve script failed");
                // The script may have run with its answer lost; returning the units of a
                // reservation that does not exist is a no-op, so try once.
                let lost = Incoming {
                    reservation_id: new_id,
                    activity_id: activity.id.clone(),
                    user_id: user_id.to_owned(),
                    quantity,
                };
                self.undo(&lost).await;
                return Err(Outcome::Unavailable("stock store unreachable"));
            }
        };
        match outcome {
            ReserveOutcome::Reserved { reservation_id } => Ok(reservation_id),
            // The client sent the script again after a lost answer (a failover) and
            // the first run had reserved: the reservation is this request's own.
            ReserveOutcome::AlreadyReserved { reservation_id } if reservation_id == new_id => {
                Ok(reservation_id)
            }
            ReserveOutcome::AlreadyReserved { reservation_id } => {
                Err(Outcome::AlreadyReserved { reservation_id })
            }
            ReserveOutcome::SoldOut => Err(Outcome::SoldOut),
            ReserveOutcome::Paused => Err(Outcome::Paused),
            ReserveOutcome::NotLoaded => {
                tracing::warn!(activity_id = %activity.id, "activity is not loaded in Redis");
                self.reconcile_now.notify_one();
                Err(Outcome::Unavailable("the sale is not loaded"))
            }
        }
    }

    /// Step 3: the message, in Kafka. `Ok(true)` once the broker has it,
    /// `Ok(false)` when it may or may not have landed (the reservation is then
    /// withdrawn through MySQL); a message never sent is undone here.
    async fn publish(&self, message: &ReservationMessage, incoming: &Incoming) -> Step<bool> {
        let reservation_id = &incoming.reservation_id;
        match self.publisher.publish(message).await {
            Ok(()) => Ok(true),
            Err(err) if err.never_sent() => {
                tracing::error!(error = %err, %reservation_id, "publish failed before sending; returning the units");
                metrics::counter!("flashsale_kafka_publish_failures_total", "sent" => "no")
                    .increment(1);
                self.undo(incoming).await;
                Err(Outcome::Unavailable("order queue unreachable"))
            }
            Err(err) => {
                // The message may still land: let MySQL decide, once, between its order
                // and its withdrawal.
                tracing::error!(error = %err, %reservation_id, "publish outcome unknown; withdrawing the reservation");
                metrics::counter!("flashsale_kafka_publish_failures_total", "sent" => "unknown")
                    .increment(1);
                Ok(false)
            }
        }
    }

    /// Step 4: the message is in the topic. The `202` is a promise, so first make
    /// it one in Redis: once acknowledged, nobody may withdraw the reservation.
    async fn acknowledge(&self, incoming: Incoming) -> Step<String> {
        let reservation_id = &incoming.reservation_id;
        match self
            .stock
            .set_fate(&incoming.activity_id, reservation_id, true)
            .instrument(redis_span("redis.fate", "fate.lua"))
            .await
        {
            Ok(FateChange::Done) => {
                self.replicated(&incoming, true).await?;
                Ok(incoming.reservation_id)
            }
            Ok(change) => {
                // The reconciler withdrew it (a publish slower than the pending
                // deadline), or Redis lost it. Its message may make it an order; MySQL
                // says which.
                tracing::warn!(?change, %reservation_id, "reservation no longer acknowledgeable; asking MySQL");
                self.withdraw(incoming).await
            }
            Err(err) => {
                tracing::warn!(error = %err, %reservation_id, "could not acknowledge the reservation; withdrawing it");
                self.withdraw(incoming).await
            }
        }
    }

    /// With replicas configured (`redis.min_replicas_acked`), a reservation waits
    /// until they hold it twice: before its message is published (a failure then
    /// withdraws it, in Redis alone), and once acknowledged, before the `202` (so a
    /// failover to a replica cannot forget the promise). If they fail at that second
    /// point, which takes a replica failing within a millisecond, the client gets
    /// `503`; the reservation stays acknowledged on the primary and its message
    /// makes it an order, which the user's reservation status shows.
    ///
    /// With `auto` and no replica online at the sale's primary, nothing waits; a
    /// `202` answered so (`answering`) is counted, being one a failover could lose.
    async fn replicated(&self, incoming: &Incoming, answering: bool) -> Step<()> {
        let reservation_id = &incoming.reservation_id;
        match self
            .stock
            .replicated(&incoming.activity_id, &incoming.user_id, reservation_id)
            .await
        {
            Ok(Replication::Held) => Ok(()),
            Ok(Replication::NoReplica) => {
                if answering {
                    metrics::counter!("flashsale_redis_unreplicated_reservations_total")
                        .increment(1);
                }
                Ok(())
            }
            other => {
                tracing::warn!(?other, %reservation_id, "replicas did not acknowledge the reservation in time");
                metrics::counter!("flashsale_redis_replica_ack_failures_total").increment(1);
                Err(Outcome::Unavailable("stock store replicas unreachable"))
            }
        }
    }

    /// Withdraws a reservation whose message may or may not be in the topic,
    /// through the one decision step (`OrderWriter::withdraw`): reserved if MySQL
    /// already holds its order, unavailable otherwise. If MySQL cannot be reached
    /// it stays marked withdrawing in Redis, and the reconciler decides it.
    async fn withdraw(&self, incoming: Incoming) -> Step<String> {
        match self
            .writer
            .withdraw(
                std::slice::from_ref(&incoming),
                "its publish failed or timed out",
            )
            .await
        {
            Ok(decided) => {
                if decided
                    .iter()
                    .any(|(_, d)| matches!(d, Decision::Ordered | Decision::Duplicate))
                {
                    tracing::info!(reservation_id = %incoming.reservation_id, "its message arrived first: an order");
                    return Ok(incoming.reservation_id);
                }
                if decided.is_empty() {
                    // Acknowledged already (its acknowledgement's answer was lost): a
                    // promise, kept once the replicas hold it.
                    self.replicated(&incoming, true).await?;
                    return Ok(incoming.reservation_id);
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, reservation_id = %incoming.reservation_id, "withdrawal not recorded; the reconciler finishes it");
            }
        }
        Err(Outcome::Unavailable("order queue unreachable"))
    }

    /// Returns a reservation that never reached the topic, and the user's right to
    /// try again. If this fails too, the reservation stays pending in Redis, where
    /// the reconciler finds it (and withdraws it, since it was never acknowledged).
    async fn undo(&self, m: &Incoming) {
        self.writer.give_back(m, RefundMode::Undo, "undone").await;
    }
}
