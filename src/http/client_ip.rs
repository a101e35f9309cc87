//! Who the client is, for the per-IP limit and the logs (docs/API.md, version 2): the
//! TCP peer, or, when the peer is one of `server.trusted_proxies`, the right-most
//! `X-Forwarded-For` address that is not itself a trusted proxy. A header from any
//! other peer is ignored, so a client cannot pick its own bucket. The per-IP
//! bucket of an IPv6 client is its /64 (`bucket`).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

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

/// The per-IP bucket a client counts against. An IPv4 address is its own
/// bucket. An IPv6 client is counted by its /64: one subscriber or host is
/// handed at least a /64 and picks addresses in it at will (privacy
/// extensions), so keying by the full address would give it 2^64 buckets. An
/// IPv4-mapped address (`::ffff:a.b.c.d`) is its IPv4 address.
pub fn bucket(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        v4 => v4,
    }
}

/// Keys the per-IP bucket by the `ClientIp`'s `bucket`.
#[derive(Debug, Clone, Copy)]
pub struct ClientIpKeyExtractor;

impl KeyExtractor for ClientIpKeyExtractor {
    type Key = IpAddr;

    fn extract<T>(&self, req: &axum::http::Request<T>) -> Result<Self::Key, GovernorError> {
        req.extensions()
            .get::<ClientIp>()
            .map(|c| bucket(c.0))
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn an_ipv6_client_is_counted_by_its_64() {
        for (client, expected) in [
            // IPv4: the address itself.
            ("203.0.113.7", "203.0.113.7"),
            // IPv4-mapped IPv6: the IPv4 address, not a /64 shared by all of IPv4.
            ("::ffff:203.0.113.7", "203.0.113.7"),
            // IPv6: the first 64 bits.
            ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::"),
            ("2001:db8:1:2::1", "2001:db8:1:2::"),
            ("2001:db8:1:3::1", "2001:db8:1:3::"),
            ("::1", "::"),
        ] {
            assert_eq!(bucket(ip(client)), ip(expected), "{client}");
        }
    }

    #[test]
    fn the_key_is_the_clients_bucket() {
        let key = |client: &str| {
            let mut req = axum::http::Request::new(());
            req.extensions_mut().insert(ClientIp(ip(client)));
            ClientIpKeyExtractor.extract(&req).expect("a key")
        };
        assert_eq!(key("2001:db8::1"), key("2001:db8::ffff:1"));
        assert_ne!(key("2001:db8::1"), key("2001:db8:0:1::1"));
        assert_ne!(key("198.51.100.1"), key("198.51.100.2"));
        // No client address: no key (an error, not one shared bucket).
        let req = axum::http::Request::new(());
        assert!(ClientIpKeyExtractor.extract(&req).is_err());
    }
}
