//! Stripe: Checkout Sessions and their signed webhooks.

pub mod signature;
