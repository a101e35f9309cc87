//! Who the client is, for the per-IP limit and the logs (docs/API.md, version 2): the
//! TCP peer, or, when the peer is one of `server.trusted_proxies`, the right-most
//! `X-Forwarded-For` address that is not itself a trusted proxy. A header from any
//! other peer is ignored, so a client cannot pick its own bucket.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::GovernorError;

use crate::config::TrustedProxies;

/// The client's address as this service sees it, in each request's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientIp(pub IpAddr);

/// Puts the `ClientIp` into the request's extensions, before anything logs or
/// limits it. Without a peer address (a router driven directly, as in tests of
/// the layers alone) the client is the unspecified address.
pub async fn resolve(
    State(proxies): State<TrustedProxies>,
    mut req: Request,
    next: Next,
) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |c| c.0.ip());
    let ip = proxies.client_ip(peer, req.headers());
    req.extensions_mut().insert(ClientIp(ip));
    next.run(req).await
}

/// Keys the per-IP bucket by the `ClientIp`.
#[derive(Debug, Clone, Copy)]
pub struct ClientIpKeyExtractor;

impl KeyExtractor for ClientIpKeyExtractor {
    type Key = IpAddr;

    fn extract<T>(&self, req: &axum::http::Request<T>) -> Result<Self::Key, GovernorError> {
        req.extensions()
            .get::<ClientIp>()
            .map(|c| c.0)
            .ok_or(GovernorError::UnableToExtractKey)
    }
}
