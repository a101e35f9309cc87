//! flashsale: a flash-sale stock reservation service.
//!
//! The request path: rate limits → auth → activity window (in memory) → Redis Lua
//! reserve (one atomic step) → Kafka publish (delivery awaited) → `202`. The order
//! consumer turns messages into MySQL orders at the database's pace. See the
//! module docs of `http`, `stock`, `kafka` and `orders`.

pub mod activity;
pub mod audit;
pub mod auth;
pub mod clock;
pub mod config;
pub mod error;
pub mod http;
pub mod input;
pub mod kafka;
pub mod operators;
pub mod orders;
pub mod payments;
pub mod periodic;
pub mod readiness;
pub mod reconcile;
pub mod reservation;
pub mod startup;
pub mod state;
pub mod stock;
pub mod stocking;
pub mod telemetry;
pub mod waiting_room;
