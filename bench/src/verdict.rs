//! Verdicts on a run: the server's own view of a sale against what the clients
//! were answered.

use serde_json::Value;
use testkit::invariants::Figures;

use crate::loadgen::LoadReport;
use crate::model::ServerCheck;

fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64()
}

/// The verdict on strategies a–c from their own counters.
pub fn check_strategy(state: &Value, load: &LoadReport) -> ServerCheck {
    let mut notes = Vec::new();
    let mut ok = true;
    let stock = as_i64(&state["stock"]).unwrap_or(0);
    let left = as_i64(&state["stock_left"]);
    let sold = as_i64(&state["units_sold"]).unwrap_or(0);
    let buyers = as_i64(&state["buyers"]["distinct_buyers"]).unwrap_or(0);
    if let Some(left) = left {
        if left < 0 {
            ok = false;
            notes.push(format!("stock ended below zero ({left})"));
        }
    }
    if sold > stock {
        ok = false;
        notes.push(format!("oversold: {sold} units of {stock}"));
    }
    if sold != load.sale.accepted as i64 {
        ok = false;
        notes.push(format!(
            "{sold} units taken but {} answered 202",
            load.sale.accepted
        ));
    }
    if buyers < sold {
        ok = false;
        notes.push(format!(
            "{sold} units went to {buyers} distinct buyers: someone holds several"
        ));
    }
    if let Some(orders) = as_i64(&state["buyers"]["orders"]) {
        if orders != sold {
            ok = false;
            notes.push(format!("{orders} orders for {sold} units"));
        }
    }
    for (key, what) in [
        (
            "double_wins",
            "users recorded twice (a second click won too)",
        ),
        (
            "negative_decrements",
            "DECRs below zero (stock read negative until INCR)",
        ),
        (
            "lock_timeouts",
            "requests gave up waiting for the lock (503)",
        ),
        ("locks_lost", "locks expired while held"),
    ] {
        let n = as_i64(&state[key]).unwrap_or(0);
        if n > 0 {
            notes.push(format!("{n} {what}"));
            if key == "double_wins" || key == "locks_lost" {
                ok = false;
            }
        }
    }
    let lowest = as_i64(&state["lowest_stock_seen"]).unwrap_or(0);
    if lowest < 0 {
        notes.push(format!("lowest stock seen: {lowest}"));
    }
    if notes.is_empty() {
        notes.push(format!("{sold} units to {buyers} distinct buyers"));
    }
    ServerCheck { ok, notes }
}

/// The verdict on the service: quiet in time, the invariants hold, and MySQL holds
/// an order for every `202`.
pub fn check_service(
    quiet: Result<(), String>,
    checked: Result<Figures, String>,
    load: &LoadReport,
) -> ServerCheck {
    let mut notes = Vec::new();
    if let Err(e) = quiet {
        notes.push(format!("not quiet when the wait ended: {e}"));
    }
    match checked {
        Ok(f) => {
            let orders = f.live_orders + f.cancelled;
            if orders != load.sale.accepted as i64 {
                notes.push(format!(
                    "{orders} orders in MySQL for {} answers 202",
                    load.sale.accepted
                ));
            }
            if notes.is_empty() {
                notes.push(format!(
                    "{orders} orders in MySQL = 202s; invariants hold (no oversell, one per user, stock conserved in Redis and MySQL)"
                ));
                return ServerCheck { ok: true, notes };
            }
        }
        Err(problems) => notes.push(problems),
    }
    ServerCheck { ok: false, notes }
}
