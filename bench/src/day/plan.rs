//! The day's schedule: which sales, when, how big, and what happens to each.
//! A pure function of the options, so a run can be told again from its seed and
//! the schedule's rules are tested without a service.

use serde::Serialize;

/// Something struck on one sale while others sell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Every Redis key of the sale deleted (an eviction, a flushed shard).
    KeysLost,
    /// The Cluster primary that owns the sale's slot SIGKILLed, then started
    /// again empty on its address (as its supervisor would).
    PrimaryKilled,
    /// The broker SIGKILLed, then started again on its data.
    BrokerRestarted,
}

impl Fault {
    pub fn label(self) -> &'static str {
        match self {
            Fault::KeysLost => "keys lost",
            Fault::PrimaryKilled => "primary killed",
            Fault::BrokerRestarted => "broker restarted",
        }
    }
}

/// One sale of the day; times are seconds from the day's start.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedSale {
    pub index: usize,
    pub starts_at_s: f64,
    pub open_s: f64,
    pub stock: u32,
    pub stock_shards: u8,
    pub waiting_room: bool,
    /// Open sales: buyers' clicks a second, each a random user of the pool.
    pub clicks_per_s: f64,
    /// Waiting rooms: users of the pool who join before the start.
    pub joiners: usize,
    /// Units added, and when (seconds after the start).
    pub top_up: Option<(f64, u32)>,
    /// Paused at (seconds after the start) for (seconds).
    pub pause: Option<(f64, f64)>,
    /// Struck at (seconds after the start).
    pub fault: Option<(f64, Fault)>,
}

impl PlannedSale {
    pub fn ends_at_s(&self) -> f64 {
        self.starts_at_s + self.open_s
    }

    pub fn name(&self) -> String {
        format!("sale {:02}", self.index + 1)
    }
}

/// Windows cycle through these lengths, so sales overlap by different amounts.
const OPEN_S: [f64; 3] = [60.0, 90.0, 120.0];
/// Stock of an open sale, cycling: some sell out, some do not.
const OPEN_STOCK: [u32; 3] = [150, 400, 1200];
const ROOM_STOCK: u32 = 100;
/// How long before its start a sale is created and loaded (a waiting room
/// opens for joins then).
pub const LEAD_S: f64 = 40.0;

/// `sales` sales over `minutes`: starts evenly spread so the last ends at the
/// day's end; every other one split over 3 stock shards; every fourth, and the
/// last, through a waiting room; top-ups, pauses, and the three faults on
/// open sales a quarter, half and three quarters through the day.
pub fn plan(sales: usize, minutes: f64, clicks_per_s: f64, joiners: usize) -> Vec<PlannedSale> {
    let sales = sales.max(1);
    let day_s = (minutes * 60.0).max(LEAD_S + OPEN_S[2]);
    let last_open = OPEN_S[(sales - 1) % OPEN_S.len()];
    let spacing = if sales > 1 {
        ((day_s - LEAD_S - last_open) / (sales - 1) as f64).max(1.0)
    } else {
        0.0
    };
    let room = |i: usize| i % 4 == 2 || i == sales - 1;
    let mut planned: Vec<PlannedSale> = (0..sales)
        .map(|i| {
            let open_s = OPEN_S[i % OPEN_S.len()];
            let waiting_room = room(i);
            PlannedSale {
                index: i,
                starts_at_s: LEAD_S + spacing * i as f64,
                open_s,
                stock: if waiting_room {
                    ROOM_STOCK
                } else {
                    OPEN_STOCK[i % OPEN_STOCK.len()]
                },
                stock_shards: if i % 2 == 1 { 3 } else { 1 },
                waiting_room,
                clicks_per_s: if waiting_room { 0.0 } else { clicks_per_s },
                joiners: if waiting_room { joiners } else { 0 },
                top_up: (i % 6 == 1).then_some((open_s * 0.5, 100)),
                pause: (i % 6 == 4).then_some((open_s * 0.4, 5.0)),
                fault: None,
            }
        })
        .collect();
    for (share, fault) in [
        (0.25, Fault::KeysLost),
        (0.5, Fault::PrimaryKilled),
        (0.75, Fault::BrokerRestarted),
    ] {
        // The open, unpaused, one-shard sale nearest that point of the day
        // (one shard, so one primary owns all of it), not struck already.
        let want = share * (sales - 1) as f64;
        let pick = planned
            .iter()
            .filter(|s| {
                !s.waiting_room && s.pause.is_none() && s.stock_shards == 1 && s.fault.is_none()
            })
            .min_by(|a, b| {
                let da = (a.index as f64 - want).abs();
                let db = (b.index as f64 - want).abs();
                da.total_cmp(&db)
            })
            .map(|s| s.index);
        if let Some(i) = pick {
            planned[i].fault = Some((planned[i].open_s * 0.5, fault));
        }
    }
    planned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_day_holds_what_the_issue_asks_for() {
        let day = plan(24, 15.0, 40.0, 300);
        assert_eq!(day.len(), 24);
        let last_end = day.iter().map(PlannedSale::ends_at_s).fold(0.0, f64::max);
        assert!(
            (last_end - 900.0).abs() < 1.0,
            "the last sale ends at {last_end}"
        );
        assert!(day.iter().any(|s| s.stock_shards == 1));
        assert!(day.iter().any(|s| s.stock_shards == 3));
        assert!(day.iter().any(|s| s.waiting_room));
        assert!(day.iter().any(|s| !s.waiting_room));
        assert!(day.iter().any(|s| s.top_up.is_some()));
        assert!(day.iter().any(|s| s.pause.is_some()));
        assert!(day.last().is_some_and(|s| s.waiting_room));
        let faults: Vec<Fault> = day.iter().filter_map(|s| s.fault.map(|f| f.1)).collect();
        assert_eq!(
            faults,
            vec![
                Fault::KeysLost,
                Fault::PrimaryKilled,
                Fault::BrokerRestarted
            ]
        );
        // Every fault strikes a sale while another sells beside it.
        for s in day.iter().filter(|s| s.fault.is_some()) {
            let at = s.starts_at_s + s.fault.map_or(0.0, |f| f.0);
            let beside = day
                .iter()
                .filter(|o| o.index != s.index)
                .any(|o| o.starts_at_s <= at && at < o.ends_at_s());
            assert!(beside, "{} is struck with no other sale open", s.name());
        }
        // Windows overlap: at some moment three sales are open.
        let most = day
            .iter()
            .map(|s| {
                day.iter()
                    .filter(|o| o.starts_at_s <= s.starts_at_s && s.starts_at_s < o.ends_at_s())
                    .count()
            })
            .max();
        assert!(most >= Some(3), "at most {most:?} sales open at once");
    }

    #[test]
    fn a_short_day_still_fits_its_sales() {
        let day = plan(3, 1.0, 10.0, 10);
        assert_eq!(day.len(), 3);
        assert!(day.windows(2).all(|w| w[0].starts_at_s < w[1].starts_at_s));
        assert!(day.iter().all(|s| s.starts_at_s >= LEAD_S));
    }
}
