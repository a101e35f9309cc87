//! An activity as MySQL stores it, the body that creates one and its
//! validation, and what a build of its Redis state reads from MySQL.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::AppError;
use crate::input::{is_valid_id, is_valid_sku};

/// An activity row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Activity {
    pub id: String,
    pub sku: String,
    pub stock: u32,
    /// Units not yet taken by orders in MySQL.
    pub available: i32,
    pub per_user_limit: u32,
    /// How many hash tags its Redis stock is split over (1 to `MAX_STOCK_SHARDS`).
    pub stock_shards: u8,
    /// First come, first served (`open`), or through the waiting room.
    #[sqlx(try_from = "String")]
    pub admission: Admission,
    /// With a waiting room: users may join this many seconds before `starts_at`.
    pub waiting_room_secs: u32,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub payment_timeout_secs: u32,
    /// What one unit costs, in the currency's minor units (cents for `usd`).
    pub price: Option<i64>,
    /// ISO 4217, lower case; present exactly when `price` is.
    pub currency: Option<String>,
    pub paused: bool,
    /// Paused by the service itself (its Redis state was lost); resumed by itself
    /// once rebuilt.
    pub auto_paused: bool,
    /// How many builds of its Redis state from MySQL were begun (0: never loaded).
    #[serde(skip)]
    pub redis_epoch: u32,
    /// The last build that was written whole into Redis: a Redis holding an older
    /// one went back in time.
    #[serde(skip)]
    pub redis_built_epoch: u32,
    /// Its Redis state is being removed, or was, after the sale ended
    /// (`redis.retain_after_end_secs`): it is never loaded again.
    #[serde(skip)]
    pub redis_removing: bool,
    /// When the removal was done.
    #[serde(skip)]
    pub redis_removed_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

/// How an activity's buyers get to reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Admission {
    /// First come, first served: whoever reaches Redis first.
    Open,
    /// Users join before the start, are drawn in a random order at the start and
    /// admitted as the stock allows (`/flash/{sku}/queue`).
    WaitingRoom,
}

impl Admission {
    pub fn as_str(self) -> &'static str {
        match self {
            Admission::Open => "open",
            Admission::WaitingRoom => "waiting_room",
        }
    }
}

impl TryFrom<String> for Admission {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "open" => Ok(Admission::Open),
            "waiting_room" => Ok(Admission::WaitingRoom),
            other => Err(format!("unknown admission {other}")),
        }
    }
}

/// Where an activity stands in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Upcoming,
    Open,
    Ended,
}

#[cfg(test)]
impl Activity {
    /// For unit tests: a sale of 10 units through a waiting room, from
    /// `starts_at` for an hour, loaded into Redis.
    pub fn room_for_tests(starts_at: DateTime<Utc>) -> Activity {
        Activity {
            id: "a1".into(),
            sku: "s1".into(),
            stock: 10,
            available: 10,
            per_user_limit: 1,
            stock_shards: 1,
            admission: Admission::WaitingRoom,
            waiting_room_secs: 600,
            starts_at,
            ends_at: starts_at + chrono::Duration::hours(1),
            payment_timeout_secs: 900,
            price: None,
            currency: None,
            paused: false,
            auto_paused: false,
            redis_epoch: 1,
            redis_built_epoch: 1,
            redis_removing: false,
            redis_removed_at: None,
            created_at: Utc::now(),
        }
    }
}

impl Activity {
    /// When users may start joining the waiting room.
    pub fn joins_from(&self) -> DateTime<Utc> {
        self.starts_at - chrono::Duration::seconds(i64::from(self.waiting_room_secs))
    }

    pub fn window(&self, now: DateTime<Utc>) -> Window {
        if now < self.starts_at {
            Window::Upcoming
        } else if now < self.ends_at {
            Window::Open
        } else {
            Window::Ended
        }
    }
}

/// Body of `POST /admin/activities`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewActivity {
    /// Generated when absent.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub id: Option<String>,
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,128}$")]
    pub sku: String,
    #[serde(deserialize_with = "crate::input::whole_i64")]
    #[schema(minimum = 1, maximum = 10_000_000)]
    pub stock: i64,
    /// At most `stock`.
    #[serde(
        default = "default_per_user_limit",
        deserialize_with = "crate::input::whole_i64"
    )]
    #[schema(minimum = 1, maximum = 10_000_000)]
    pub per_user_limit: i64,
    /// Between the years 1970 and 9999.
    pub starts_at: DateTime<Utc>,
    /// After `starts_at`, before the year 10000.
    pub ends_at: DateTime<Utc>,
    #[serde(
        default = "default_payment_timeout",
        deserialize_with = "crate::input::whole_i64"
    )]
    #[schema(minimum = 1, maximum = 604_800)]
    pub payment_timeout_secs: i64,
    /// How many hash tags the Redis stock is split over.
    #[serde(
        default = "default_stock_shards",
        deserialize_with = "crate::input::whole_i64"
    )]
    #[schema(minimum = 1, maximum = 64)]
    pub stock_shards: i64,
    /// `open` (first come, first served) or `waiting_room`.
    #[serde(default = "default_admission")]
    pub admission: Admission,
    /// With a waiting room: how long before `starts_at` users may join.
    #[serde(
        default = "default_waiting_room_secs",
        deserialize_with = "crate::input::whole_i64"
    )]
    #[schema(minimum = 0, maximum = 604_800)]
    pub waiting_room_secs: i64,
    /// What one unit costs, an integer of the currency's minor units (cents
    /// for `usd`, yen for `jpy`); given with `currency` or not at all.
    #[serde(default, deserialize_with = "crate::input::integer_i64_opt")]
    #[schema(minimum = 0, maximum = 1e12)]
    pub price: Option<i64>,
    /// ISO 4217, lower case (`usd`, `eur`, `jpy`); given with `price`.
    #[schema(pattern = "^[a-z]{3}$")]
    #[serde(default)]
    pub currency: Option<String>,
}

fn default_admission() -> Admission {
    Admission::Open
}

fn default_waiting_room_secs() -> i64 {
    600
}

/// Longest a waiting room may open before its sale: one week.
pub const MAX_WAITING_ROOM_SECS: i64 = 7 * 24 * 3600;

fn default_stock_shards() -> i64 {
    1
}

fn default_per_user_limit() -> i64 {
    1
}

fn default_payment_timeout() -> i64 {
    900
}

/// Largest stock one activity may hold; far above any flash sale, far below
/// the integer limits of Redis and MySQL.
pub const MAX_STOCK: i64 = 10_000_000;
/// Longest payment window: one week.
pub const MAX_PAYMENT_TIMEOUT_SECS: i64 = 7 * 24 * 3600;
/// Most hash tags one activity's stock may be split over.
pub const MAX_STOCK_SHARDS: i64 = 64;
/// Highest price, in minor units: far above any unit's, far below MySQL's
/// and JavaScript's integer limits.
pub const MAX_PRICE: i64 = 1_000_000_000_000;

/// Whether `c` is written as an ISO 4217 code is, in lower case.
fn is_currency_code(c: &str) -> bool {
    c.len() == 3 && c.bytes().all(|b| b.is_ascii_lowercase())
}

/// What a (re)build writes into Redis, read from MySQL in one snapshot.
#[derive(Debug, Clone, Default)]
pub struct Build {
    /// Units MySQL still has for sale.
    pub available: i64,
    pub paused: bool,
    /// The build's number (MySQL's `redis_epoch`); Redis keeps it in `…:epoch`.
    pub epoch: u32,
    /// (user id, reservation id) of every user whose purchase right is spent.
    pub buyers: Vec<(String, String)>,
    /// Reservations of failed and cancelled orders: their units are in `available`.
    pub returned: Vec<String>,
}

/// A validated activity, ready to insert.
#[derive(Debug, Clone)]
pub struct ValidActivity {
    pub id: String,
    pub sku: String,
    pub stock: u32,
    pub per_user_limit: u32,
    pub stock_shards: u8,
    pub admission: Admission,
    pub waiting_room_secs: u32,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub payment_timeout_secs: u32,
    pub price: Option<i64>,
    pub currency: Option<String>,
}

impl NewActivity {
    pub fn validate(self) -> Result<ValidActivity, AppError> {
        let id = match self.id {
            Some(id) if is_valid_id(&id) => id,
            Some(_) => {
                return Err(AppError::invalid(
                    "id must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'",
                ))
            }
            None => uuid::Uuid::now_v7().simple().to_string(),
        };
        if !is_valid_sku(&self.sku) {
            return Err(AppError::invalid(
                "sku must be 1 to 128 characters of A-Z, a-z, 0-9, '_', '-', '.' or ':'",
            ));
        }
        if !(1..=MAX_STOCK).contains(&self.stock) {
            return Err(AppError::invalid(format!(
                "stock must be between 1 and {MAX_STOCK}"
            )));
        }
        if self.per_user_limit < 1 || self.per_user_limit > self.stock {
            return Err(AppError::invalid(
                "per_user_limit must be at least 1 and at most stock",
            ));
        }
        use chrono::Datelike;
        if [self.starts_at, self.ends_at]
            .iter()
            .any(|t| !(1970..=9999).contains(&t.year()))
        {
            return Err(AppError::invalid(
                "starts_at and ends_at must lie between the years 1970 and 9999",
            ));
        }
        if self.ends_at <= self.starts_at {
            return Err(AppError::invalid("ends_at must be after starts_at"));
        }
        if !(1..=MAX_PAYMENT_TIMEOUT_SECS).contains(&self.payment_timeout_secs) {
            return Err(AppError::invalid(format!(
                "payment_timeout_secs must be between 1 and {MAX_PAYMENT_TIMEOUT_SECS}"
            )));
        }
        if !(1..=MAX_STOCK_SHARDS).contains(&self.stock_shards) {
            return Err(AppError::invalid(format!(
                "stock_shards must be between 1 and {MAX_STOCK_SHARDS}"
            )));
        }
        if !(0..=MAX_WAITING_ROOM_SECS).contains(&self.waiting_room_secs) {
            return Err(AppError::invalid(format!(
                "waiting_room_secs must be between 0 and {MAX_WAITING_ROOM_SECS}"
            )));
        }
        match (self.price, &self.currency) {
            (None, None) => {}
            (Some(price), Some(currency)) => {
                if !(0..=MAX_PRICE).contains(&price) {
                    return Err(AppError::invalid(format!(
                        "price must be a whole number of the currency's minor units between 0 and {MAX_PRICE}"
                    )));
                }
                if !is_currency_code(currency) {
                    return Err(AppError::invalid(
                        "currency must be an ISO 4217 code in lower case, such as usd",
                    ));
                }
            }
            _ => {
                return Err(AppError::invalid(
                    "price and currency go together: give both or neither",
                ))
            }
        }
        // The ranges above were checked, so these conversions cannot fail.
        let to_u32 = |v: i64| u32::try_from(v).map_err(|_| AppError::invalid("value out of range"));
        Ok(ValidActivity {
            id,
            sku: self.sku,
            stock: to_u32(self.stock)?,
            per_user_limit: to_u32(self.per_user_limit)?,
            stock_shards: u8::try_from(self.stock_shards)
                .map_err(|_| AppError::invalid("value out of range"))?,
            admission: self.admission,
            waiting_room_secs: to_u32(self.waiting_room_secs)?,
            // MySQL DATETIME(3) keeps milliseconds; truncate now so that what we
            // answer equals what we store.
            starts_at: truncate_ms(self.starts_at),
            ends_at: truncate_ms(self.ends_at),
            payment_timeout_secs: to_u32(self.payment_timeout_secs)?,
            price: self.price,
            currency: self.currency,
        })
    }
}

fn truncate_ms(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(stock: i64, limit: i64) -> NewActivity {
        let now = Utc::now();
        NewActivity {
            id: None,
            sku: "sku-1".into(),
            stock,
            per_user_limit: limit,
            starts_at: now,
            ends_at: now + chrono::Duration::hours(1),
            payment_timeout_secs: 900,
            stock_shards: 1,
            admission: Admission::Open,
            waiting_room_secs: 600,
            price: None,
            currency: None,
        }
    }

    #[test]
    fn validation() {
        assert!(new(10, 1).validate().is_ok());
        assert!(new(0, 1).validate().is_err());
        assert!(new(10, 0).validate().is_err());
        assert!(new(10, 11).validate().is_err());
        let mut a = new(10, 1);
        a.ends_at = a.starts_at;
        assert!(a.validate().is_err());
        let mut a = new(10, 1);
        a.sku = "a/b".into();
        assert!(a.validate().is_err());
        for (shards, ok) in [(0, false), (1, true), (64, true), (65, false)] {
            let mut a = new(10, 1);
            a.stock_shards = shards;
            assert_eq!(a.validate().is_ok(), ok, "stock_shards {shards}");
        }
        let generated = new(10, 1).validate().expect("valid");
        assert!(is_valid_id(&generated.id));
    }
}
