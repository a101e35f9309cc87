//! Stripe: Checkout Sessions and their signed webhooks.

pub mod client;
pub mod signature;
