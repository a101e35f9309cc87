//! Activities: the sale definitions stored in MySQL (the source of truth), their
//! validation, and the in-memory cache the hot path reads instead of the database.

mod cache;
mod definition;
mod repo;

pub use cache::{ActivityCache, LOOKED_AFTER};
pub use definition::{
    Activity, Admission, Build, NewActivity, ValidActivity, Window, MAX_PAYMENT_TIMEOUT_SECS,
    MAX_STOCK, MAX_STOCK_SHARDS, MAX_WAITING_ROOM_SECS,
};
pub use repo::{ActivityRepo, BuildLock, CreateError, TopUpError};
