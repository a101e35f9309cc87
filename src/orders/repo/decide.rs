//! The middle of [`OrderRepo::apply`](super::OrderRepo::apply): what becomes of
//! each reservation of a batch, given what MySQL holds for it. It does no I/O, so
//! the rules that keep the units right are tested here without MySQL; `apply`
//! reads the [`Known`] under the activities' locks before and writes the
//! [`Plan`] in the same transaction after.

use std::collections::{HashMap, HashSet};

/// One reservation as the consumer hands it to MySQL.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub reservation_id: String,
    pub activity_id: String,
    pub user_id: String,
    pub quantity: u32,
}

/// What MySQL decided for one reservation. Every reservation is decided once, under
/// the activity's row lock; a later look at it finds the decision already made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new order awaits payment; the units were taken from the DB count.
    Ordered,
    /// The reservation is an order already (a redelivery, or its message arrived
    /// after the reconciler honoured it): nothing changed.
    Duplicate,
    /// The reservation has a failed row already: nothing changed.
    AlreadyFailed,
    /// The reservation is withdrawn (now, or before): it never becomes an order,
    /// and its units and the user's right go back to Redis.
    Withdrawn,
    /// Recorded as failed for bad data (an unknown activity); its units go back.
    Failed { reason: &'static str },
    /// MySQL has no units left for it: an incident (Redis handed out more than
    /// MySQL holds). Recorded as failed with nothing owed back: Redis is lowered
    /// to `available` (MySQL's count after the batch), never refunded.
    Refused { available: i64 },
    /// The user already holds an order from another reservation: this one loses
    /// and its units must go back to Redis (no row is written for it).
    Superseded,
}

/// What a reservation MySQL has not decided yet becomes.
#[derive(Debug, Clone, Copy)]
pub enum NewRows {
    /// An order awaiting payment, taking its units (the consumer, or the reconciler
    /// honouring an acknowledged reservation).
    Order,
    /// A withdrawal with this reason: the reservation never becomes an order (the
    /// request whose publish failed, or the reconciler, before the message came).
    Withdraw(&'static str),
}

/// An activity as the batch's lock found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Locked {
    pub payment_timeout_secs: u32,
    /// Units MySQL still has for sale.
    pub available: i64,
}

/// What MySQL holds for a batch, read under its activities' locks.
#[derive(Debug, Clone, Default)]
pub(super) struct Known {
    /// The batch's activities that exist.
    pub activities: HashMap<String, Locked>,
    /// Reservations that have an order row: whether that row is a failed one.
    pub orders: HashMap<String, bool>,
    /// (activity, user) pairs holding a live or cancelled order (a failed row
    /// spends no purchase right).
    pub buyers: HashSet<(String, String)>,
    /// Reservations recorded as withdrawn.
    pub withdrawn: HashSet<String>,
}

/// One row the batch inserts into `orders`.
#[derive(Debug)]
pub(super) struct NewOrder<'a> {
    pub m: &'a Incoming,
    pub status: &'static str,
    pub reason: Option<&'static str>,
    /// Seconds to pay; `None` (a NULL deadline) for a failed row.
    pub timeout: Option<u32>,
    /// Whether nothing is owed back to Redis for it.
    pub returned: bool,
}

impl<'a> NewOrder<'a> {
    fn failed(m: &'a Incoming, reason: &'static str, returned: bool) -> Self {
        NewOrder {
            m,
            status: "failed",
            reason: Some(reason),
            timeout: None,
            returned,
        }
    }
}

/// What a batch decided, and what it writes to make that so.
#[derive(Debug, Default)]
pub(super) struct Plan<'a> {
    /// One per reservation of the batch, in its order.
    pub decisions: Vec<Decision>,
    pub orders: Vec<NewOrder<'a>>,
    /// Reservations withdrawn now, with their reason.
    pub withdrawals: Vec<(&'a Incoming, &'static str)>,
    /// Units the new orders take, per activity.
    pub taken: HashMap<&'a str, i64>,
    /// Messages of reservations that are orders already, per reservation.
    pub redelivered: HashMap<&'a str, u32>,
}

/// Decides each message of `batch` in arrival order: a known reservation is a
/// redelivery, a withdrawn one stays withdrawn, one not decided yet becomes what
/// `new_rows` says; as an order, it loses to another order of the same user, and
/// takes units only while the activity's `available` covers them.
pub(super) fn decide(batch: &[Incoming], known: Known, new_rows: NewRows) -> Plan<'_> {
    let mut deciding = Deciding {
        known,
        new_rows,
        plan: Plan {
            decisions: Vec::with_capacity(batch.len()),
            ..Plan::default()
        },
    };
    for m in batch {
        let decision = deciding.one(m);
        deciding.plan.decisions.push(decision);
    }
    deciding.report_available(batch);
    deciding.plan
}

/// A batch being decided: what MySQL holds, updated as each message is decided.
struct Deciding<'a> {
    known: Known,
    new_rows: NewRows,
    plan: Plan<'a>,
}

impl<'a> Deciding<'a> {
    fn one(&mut self, m: &'a Incoming) -> Decision {
        if let Some(&failed) = self.known.orders.get(&m.reservation_id) {
            *self
                .plan
                .redelivered
                .entry(m.reservation_id.as_str())
                .or_default() += 1;
            return if failed {
                Decision::AlreadyFailed
            } else {
                Decision::Duplicate
            };
        }
        if self.known.withdrawn.contains(&m.reservation_id) {
            return Decision::Withdrawn;
        }
        if let NewRows::Withdraw(reason) = self.new_rows {
            self.plan.withdrawals.push((m, reason));
            self.known.withdrawn.insert(m.reservation_id.clone());
            return Decision::Withdrawn;
        }
        let user = (m.activity_id.clone(), m.user_id.clone());
        if self.known.buyers.contains(&user) {
            return Decision::Superseded;
        }
        let decision = self.order(m);
        if decision == Decision::Ordered {
            self.known.buyers.insert(user);
        }
        self.known
            .orders
            .insert(m.reservation_id.clone(), decision != Decision::Ordered);
        decision
    }

    /// A new order for `m`, or a failed row when its activity is unknown or has
    /// too few units.
    fn order(&mut self, m: &'a Incoming) -> Decision {
        let units = i64::from(m.quantity);
        match self.known.activities.get_mut(&m.activity_id) {
            None => {
                let reason = "unknown activity";
                self.plan.orders.push(NewOrder::failed(m, reason, false));
                Decision::Failed { reason }
            }
            Some(a) if a.available >= units => {
                a.available -= units;
                *self.plan.taken.entry(m.activity_id.as_str()).or_default() += units;
                self.plan.orders.push(NewOrder {
                    m,
                    status: "pending_payment",
                    reason: None,
                    timeout: Some(a.payment_timeout_secs),
                    returned: false,
                });
                Decision::Ordered
            }
            Some(_) => {
                // Nothing is owed back: MySQL never had these units.
                let reason = "no units left in the database";
                self.plan.orders.push(NewOrder::failed(m, reason, true));
                Decision::Refused { available: 0 }
            }
        }
    }

    /// A refusal reports MySQL's count as it will be committed, after the batch.
    fn report_available(&mut self, batch: &[Incoming]) {
        for (m, d) in batch.iter().zip(self.plan.decisions.iter_mut()) {
            if let Decision::Refused { available } = d {
                *available = self
                    .known
                    .activities
                    .get(&m.activity_id)
                    .map_or(0, |a| a.available);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn msg(reservation: &str, activity: &str, user: &str, quantity: u32) -> Incoming {
        Incoming {
            reservation_id: reservation.to_owned(),
            activity_id: activity.to_owned(),
            user_id: user.to_owned(),
            quantity,
        }
    }

    /// MySQL holding one activity `a` with `available` units, nothing else.
    fn holding(available: i64) -> Known {
        let mut known = Known::default();
        known.activities.insert(
            "a".to_owned(),
            Locked {
                payment_timeout_secs: 900,
                available,
            },
        );
        known
    }

    #[test]
    fn a_new_reservation_becomes_an_order_taking_its_units() {
        let batch = [msg("r1", "a", "u1", 2)];
        let plan = decide(&batch, holding(5), NewRows::Order);
        assert_eq!(plan.decisions, [Decision::Ordered]);
        assert_eq!(plan.taken.get("a"), Some(&2));
        let row = &plan.orders[0];
        assert_eq!(
            (row.status, row.reason, row.timeout, row.returned),
            ("pending_payment", None, Some(900), false)
        );
        assert!(plan.withdrawals.is_empty() && plan.redelivered.is_empty());
    }

    #[test]
    fn a_known_reservation_is_a_redelivery_and_writes_nothing_new() {
        let mut known = holding(5);
        known.orders.insert("r1".into(), false);
        known.orders.insert("r2".into(), true);
        let batch = [msg("r1", "a", "u1", 1), msg("r2", "a", "u2", 1)];
        let plan = decide(&batch, known, NewRows::Order);
        assert_eq!(
            plan.decisions,
            [Decision::Duplicate, Decision::AlreadyFailed]
        );
        assert!(plan.orders.is_empty() && plan.taken.is_empty());
        assert_eq!(plan.redelivered.get("r1"), Some(&1));
        assert_eq!(plan.redelivered.get("r2"), Some(&1));
    }

    #[test]
    fn the_same_reservation_twice_in_a_batch_is_ordered_once() {
        let batch = [msg("r1", "a", "u1", 1), msg("r1", "a", "u1", 1)];
        let plan = decide(&batch, holding(5), NewRows::Order);
        assert_eq!(plan.decisions, [Decision::Ordered, Decision::Duplicate]);
        assert_eq!(plan.orders.len(), 1);
        assert_eq!(plan.taken.get("a"), Some(&1));
        assert_eq!(plan.redelivered.get("r1"), Some(&1));
    }

    #[test]
    fn a_withdrawn_reservation_never_becomes_an_order() {
        let mut known = holding(5);
        known.withdrawn.insert("r1".into());
        let batch = [msg("r1", "a", "u1", 1)];
        let plan = decide(&batch, known, NewRows::Order);
        assert_eq!(plan.decisions, [Decision::Withdrawn]);
        assert!(plan.orders.is_empty() && plan.withdrawals.is_empty());
    }

    #[test]
    fn withdrawing_writes_one_withdrawal_per_reservation() {
        let batch = [msg("r1", "a", "u1", 1), msg("r1", "a", "u1", 1)];
        let plan = decide(&batch, holding(5), NewRows::Withdraw("publish failed"));
        assert_eq!(plan.decisions, [Decision::Withdrawn, Decision::Withdrawn]);
        assert_eq!(plan.withdrawals.len(), 1);
        assert_eq!(plan.withdrawals[0].1, "publish failed");
        assert!(plan.orders.is_empty() && plan.taken.is_empty());
    }

    #[test]
    fn withdrawing_leaves_a_decided_order_alone() {
        let mut known = holding(5);
        known.orders.insert("r1".into(), false);
        let batch = [msg("r1", "a", "u1", 1)];
        let plan = decide(&batch, known, NewRows::Withdraw("late"));
        assert_eq!(plan.decisions, [Decision::Duplicate]);
        assert!(plan.withdrawals.is_empty());
    }

    #[test]
    fn a_user_with_an_order_loses_a_second_reservation() {
        let mut known = holding(5);
        known.buyers.insert(("a".into(), "u1".into()));
        let batch = [
            msg("r1", "a", "u1", 1),
            msg("r2", "a", "u2", 1),
            msg("r3", "a", "u2", 1),
        ];
        let plan = decide(&batch, known, NewRows::Order);
        assert_eq!(
            plan.decisions,
            [
                Decision::Superseded,
                Decision::Ordered,
                Decision::Superseded
            ]
        );
        assert_eq!(plan.orders.len(), 1);
        assert_eq!(plan.taken.get("a"), Some(&1));
    }

    #[test]
    fn a_failed_row_spends_no_purchase_right() {
        let batch = [msg("r1", "a", "u1", 9), msg("r2", "a", "u1", 1)];
        let plan = decide(&batch, holding(5), NewRows::Order);
        assert_eq!(
            plan.decisions,
            [Decision::Refused { available: 4 }, Decision::Ordered]
        );
    }

    #[test]
    fn an_unknown_activity_fails_with_its_units_owed_back() {
        let batch = [msg("r1", "b", "u1", 1)];
        let plan = decide(&batch, holding(5), NewRows::Order);
        assert_eq!(
            plan.decisions,
            [Decision::Failed {
                reason: "unknown activity"
            }]
        );
        let row = &plan.orders[0];
        assert_eq!(
            (row.status, row.timeout, row.returned),
            ("failed", None, false)
        );
    }

    #[test]
    fn a_refusal_reports_the_count_left_after_the_batch() {
        let batch = [
            msg("r1", "a", "u1", 3),
            msg("r2", "a", "u2", 1),
            msg("r3", "a", "u3", 1),
        ];
        let plan = decide(&batch, holding(2), NewRows::Order);
        assert_eq!(
            plan.decisions,
            [
                Decision::Refused { available: 0 },
                Decision::Ordered,
                Decision::Ordered
            ]
        );
        let row = &plan.orders[0];
        assert_eq!(
            (row.status, row.reason, row.returned),
            ("failed", Some("no units left in the database"), true)
        );
    }

    #[test]
    fn an_empty_batch_decides_nothing() {
        let plan = decide(&[], holding(5), NewRows::Order);
        assert!(plan.decisions.is_empty() && plan.orders.is_empty());
    }

    /// A small world, so that random batches often share reservations, users
    /// and activities, and often run out of units.
    const ACTIVITIES: [&str; 3] = ["a0", "a1", "gone"];

    fn any_known() -> impl Strategy<Value = Known> {
        (
            proptest::collection::vec(0i64..8, 2),
            proptest::collection::hash_map(0u8..8, any::<bool>(), 0..4),
            proptest::collection::hash_set((0usize..2, 0u8..5), 0..4),
            proptest::collection::hash_set(0u8..8, 0..3),
        )
            .prop_map(|(available, orders, buyers, withdrawn)| Known {
                // "gone" is never in MySQL.
                activities: available
                    .into_iter()
                    .enumerate()
                    .map(|(i, available)| {
                        let a = Locked {
                            payment_timeout_secs: 60,
                            available,
                        };
                        (ACTIVITIES[i].to_owned(), a)
                    })
                    .collect(),
                orders: orders
                    .into_iter()
                    .map(|(r, failed)| (format!("r{r}"), failed))
                    .collect(),
                buyers: buyers
                    .into_iter()
                    .map(|(a, u)| (ACTIVITIES[a].to_owned(), format!("u{u}")))
                    .collect(),
                withdrawn: withdrawn.into_iter().map(|r| format!("r{r}")).collect(),
            })
    }

    /// A batch over the small world; a reservation keeps its activity, user
    /// and units wherever it appears, as a redelivered message does.
    fn any_batch() -> impl Strategy<Value = Vec<Incoming>> {
        proptest::collection::vec(0u8..8, 0..24).prop_map(|rs| {
            rs.into_iter()
                .map(|r| {
                    let activity = ACTIVITIES[usize::from(r % 3)];
                    msg(
                        &format!("r{r}"),
                        activity,
                        &format!("u{}", r % 5),
                        u32::from(r % 3) + 1,
                    )
                })
                .collect()
        })
    }

    fn any_new_rows() -> impl Strategy<Value = NewRows> {
        prop_oneof![Just(NewRows::Order), Just(NewRows::Withdraw("withdrawn"))]
    }

    proptest! {
        #[test]
        fn every_reservation_is_decided_once(
            known in any_known(),
            batch in any_batch(),
            new_rows in any_new_rows(),
        ) {
            let plan = decide(&batch, known.clone(), new_rows);
            prop_assert_eq!(plan.decisions.len(), batch.len());
            // At most one new row per reservation, and none for one MySQL had
            // decided already.
            let mut written: HashMap<&str, usize> = HashMap::new();
            let rows = plan.orders.iter().map(|o| o.m).chain(plan.withdrawals.iter().map(|w| w.0));
            for m in rows {
                *written.entry(m.reservation_id.as_str()).or_default() += 1;
                prop_assert!(!known.orders.contains_key(&m.reservation_id));
                prop_assert!(!known.withdrawn.contains(&m.reservation_id));
            }
            prop_assert!(written.values().all(|n| *n == 1), "written twice: {:?}", written);
            // The order rows are those of the messages decided as new orders or
            // failures, in the batch's order.
            let deciding: Vec<&Incoming> = batch
                .iter()
                .zip(&plan.decisions)
                .filter(|(_, d)| matches!(d, Decision::Ordered | Decision::Failed { .. } | Decision::Refused { .. }))
                .map(|(m, _)| m)
                .collect();
            prop_assert_eq!(deciding.len(), plan.orders.len());
            for (m, row) in deciding.iter().zip(&plan.orders) {
                prop_assert!(std::ptr::eq(*m, row.m));
            }
            // Withdrawing decides every reservation MySQL had not decided.
            if let NewRows::Withdraw(_) = new_rows {
                for m in &batch {
                    let undecided = !known.orders.contains_key(&m.reservation_id)
                        && !known.withdrawn.contains(&m.reservation_id);
                    prop_assert_eq!(written.contains_key(m.reservation_id.as_str()), undecided);
                }
            } else {
                prop_assert!(plan.withdrawals.is_empty());
            }
            // Once decided in the batch, a reservation's later messages find the
            // decision, as a redelivery would.
            let mut first: HashMap<&str, &Decision> = HashMap::new();
            let mut redelivered: HashMap<&str, u32> = HashMap::new();
            for (m, d) in batch.iter().zip(&plan.decisions) {
                if matches!(d, Decision::Duplicate | Decision::AlreadyFailed) {
                    *redelivered.entry(m.reservation_id.as_str()).or_default() += 1;
                }
                match first.get(m.reservation_id.as_str()) {
                    Some(Decision::Ordered) => prop_assert_eq!(d, &Decision::Duplicate),
                    Some(Decision::Failed { .. } | Decision::Refused { .. }) => {
                        prop_assert_eq!(d, &Decision::AlreadyFailed)
                    }
                    Some(Decision::Withdrawn) => prop_assert_eq!(d, &Decision::Withdrawn),
                    _ => {
                        first.insert(m.reservation_id.as_str(), d);
                    }
                }
            }
            prop_assert_eq!(redelivered, plan.redelivered);
        }

        #[test]
        fn units_are_conserved(known in any_known(), batch in any_batch()) {
            let plan = decide(&batch, known.clone(), NewRows::Order);
            let mut sold: HashMap<&str, i64> = HashMap::new();
            for (m, d) in batch.iter().zip(&plan.decisions) {
                if *d == Decision::Ordered {
                    *sold.entry(m.activity_id.as_str()).or_default() += i64::from(m.quantity);
                }
            }
            for (id, a) in &known.activities {
                let taken = plan.taken.get(id.as_str()).copied().unwrap_or(0);
                prop_assert_eq!(taken, sold.get(id.as_str()).copied().unwrap_or(0));
                let left = a.available - taken;
                prop_assert!(left >= 0, "{} below zero: {}", id, left);
                // A refusal reports what is left once the batch is written.
                for (m, d) in batch.iter().zip(&plan.decisions) {
                    if let Decision::Refused { available } = d {
                        if m.activity_id == *id {
                            prop_assert_eq!(*available, left);
                        }
                    }
                }
            }
            prop_assert!(plan.taken.keys().all(|a| known.activities.contains_key(*a)));
        }

        #[test]
        fn no_user_holds_more_than_one_order(known in any_known(), batch in any_batch()) {
            let plan = decide(&batch, known.clone(), NewRows::Order);
            let mut held: HashMap<(&str, &str), usize> = HashMap::new();
            for (m, d) in batch.iter().zip(&plan.decisions) {
                if *d == Decision::Ordered {
                    let user = (m.activity_id.clone(), m.user_id.clone());
                    prop_assert!(!known.buyers.contains(&user), "{:?} bought before", user);
                    *held.entry((m.activity_id.as_str(), m.user_id.as_str())).or_default() += 1;
                }
            }
            prop_assert!(held.values().all(|n| *n == 1), "{:?}", held);
        }
    }
}
