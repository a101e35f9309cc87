//! Orders in MySQL: the consumer that creates them from the reservation topic, the
//! repository, and the sweeper that cancels the unpaid ones.

pub mod consumer;
mod repo;
mod stall;
pub mod sweeper;

pub use consumer::{dead_letters_seen, OrderConsumer, OrderWriter};
pub use repo::{
    is_permanent, Decision, Incoming, NewRows, Order, OrderRepo, OrderStatus, PayOutcome,
};
pub use sweeper::Sweeper;
