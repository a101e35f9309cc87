//! Black-box tests of the HTTP API against real Redis, MariaDB and a Kafka-protocol
//! broker. One file per feature; `helpers` builds an isolated app per test.

mod admin;
mod audit;
mod buyer;
mod errors;
mod gate;
mod helpers;
mod identity;
mod kafka_semantics;
mod openapi;
mod openapi_copy;
mod ops;
mod orders;
mod polls;
mod rate_limit;
mod reconcile;
mod reserve;
mod retention;
mod shards;
mod stripe_client;
mod topics;
mod topup;
mod traces;
mod ui;
mod waiting_room;
