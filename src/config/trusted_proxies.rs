//! Which peers' `X-Forwarded-For` is believed (`server.trusted_proxies`), and
//! the client that header names behind them: the right-most address that is not
//! itself a trusted proxy. A setting, read by the HTTP layer's client-address
//! step (`http::client_ip`), so it sits with the settings.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use axum::http::HeaderMap;
use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

/// The proxies whose `X-Forwarded-For` is believed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Arc<Vec<IpNet>>);

impl TrustedProxies {
    /// Addresses (`10.0.0.1`, `::1`) or CIDRs (`10.0.0.0/8`).
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        let mut nets = Vec::with_capacity(items.len());
        for item in items {
            let item = item.as_ref().trim();
            if item.is_empty() {
                continue;
            }
            let net = match item.parse::<IpNet>() {
                Ok(net) => net,
                Err(_) => item
                    .parse::<IpAddr>()
                    .map(IpNet::from)
                    .map_err(|_| format!("{item:?} is neither an IP address nor a CIDR"))?,
            };
            nets.push(net);
        }
        Ok(TrustedProxies(Arc::new(nets)))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|net| net.contains(&ip))
    }

    /// The client behind `peer`, given the request's headers.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.trusts(peer) {
            return peer;
        }
        // Every X-Forwarded-For header, in order, as one list; walked from the
        // right, each hop a trusted proxy appended, until one that is not trusted.
        let hops: Vec<&str> = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect();
        for hop in hops.iter().rev() {
            match hop.parse::<IpAddr>() {
                Ok(ip) if self.trusts(ip.to_canonical()) => continue,
                Ok(ip) => return ip.to_canonical(),
                // Not an address: nothing to its left can be believed.
                Err(_) => break,
            }
        }
        peer
    }
}

/// The list as it would be written in the setting: `10.0.0.0/8,127.0.0.1/32`.
impl fmt::Display for TrustedProxies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, net) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{net}")?;
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for TrustedProxies {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let items = Vec::<String>::deserialize(d)?;
        TrustedProxies::parse(&items).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().expect("header value"));
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn an_untrusted_peer_is_the_client() {
        let none = TrustedProxies::default();
        assert_eq!(
            none.client_ip(ip("203.0.113.9"), &headers(&["1.2.3.4"])),
            ip("203.0.113.9")
        );
        let some = TrustedProxies::parse(&["10.0.0.0/8"]).expect("parses");
        assert_eq!(
            some.client_ip(ip("203.0.113.9"), &headers(&["1.2.3.4"])),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn behind_trusted_proxies_the_rightmost_untrusted_hop_is_the_client() {
        let p = TrustedProxies::parse(&["127.0.0.1", "10.0.0.0/8"]).expect("parses");
        // The client forged the first hop; the edge proxy appended the real one.
        let h = headers(&["6.6.6.6, 198.51.100.7", "10.1.2.3"]);
        assert_eq!(p.client_ip(ip("127.0.0.1"), &h), ip("198.51.100.7"));
        // Only trusted hops: the peer itself.
        assert_eq!(
            p.client_ip(ip("127.0.0.1"), &headers(&["10.0.0.1"])),
            ip("127.0.0.1")
        );
        // No header.
        assert_eq!(p.client_ip(ip("127.0.0.1"), &headers(&[])), ip("127.0.0.1"));
        // Garbage stops the walk.
        assert_eq!(
            p.client_ip(ip("127.0.0.1"), &headers(&["1.1.1.1, junk, 10.0.0.2"])),
            ip("127.0.0.1")
        );
        // IPv4-mapped IPv6 peers count as their IPv4 address.
        assert_eq!(
            p.client_ip(ip("::ffff:127.0.0.1"), &headers(&["192.0.2.1"])),
            ip("192.0.2.1")
        );
    }

    #[test]
    fn bad_entries_are_refused() {
        assert!(TrustedProxies::parse(&["10.0.0.0/33"]).is_err());
        assert!(TrustedProxies::parse(&["proxy.local"]).is_err());
        assert!(TrustedProxies::parse(&["::1", "fd00::/8", ""]).is_ok());
    }
}
