//! Orders in MySQL: the consumer that creates them from the reservation topic, the
//! writer (the one decision step it and the others share), the repository, and
//! the sweeper that cancels the unpaid ones.

pub mod consumer;
mod ghosts;
pub mod pace;
mod repo;
pub mod sweeper;
mod writer;

pub use consumer::{dead_letters_seen, OrderConsumer};
pub use repo::{
    is_permanent, Decision, Incoming, NewRows, Order, OrderRepo, OrderStatus, PayOutcome,
};
pub use sweeper::Sweeper;
pub use writer::{BatchReport, OrderWriter};
