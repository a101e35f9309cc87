//! Payment providers (API version 4, "Payments"). Today the only provider is
//! `none` (`payments.provider`): the order's owner marks it paid
//! (`crate::orders`). What Stripe needs is built here piece by piece, each
//! tested on its own before the provider is offered: [`stripe::signature`]
//! checks a webhook's `Stripe-Signature`.

pub mod stripe;
