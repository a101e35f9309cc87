//! The buyers' filter, read side: a Bloom filter of a shard's buyers that the
//! scripts recording a buyer keep in Redis (`filter.lua`, prefixed to
//! `reserve.lua`, `preload.lua` and `confirm.lua`), read once when a sold-out
//! gate shuts. It answers "certainly not a buyer" or "maybe"; a maybe goes to
//! Redis, which answers exactly. A buyer is never "certainly not": every script
//! that writes `buyers` sets the buyer's bits in the same atomic step.
//!
//! The layout and the hashing are `filter.lua`'s, constant for constant.

use sha1::{Digest, Sha1};

/// Bits before the first layer: the format byte and the count of buyers (an
/// `i32`), checked by `filter_read.lua` against the buyers before a gate gets
/// the filter.
const HEADER_BITS: u64 = 40;
/// Buyers in layer 0; each next layer holds twice as many.
const BASE: u64 = 1024;
/// Bits per buyer in every layer.
const BITS: u64 = 16;
/// Bits each buyer sets in its layer.
const HASHES: u64 = 8;
/// Layers at most; the last one takes every buyer past the others.
const LAYERS: u32 = 16;
/// The format byte of a filter written by a build, in this layout.
const COMPLETE: u8 = 2;

/// A user id's two hash words: the first two big-endian 32-bit words of its
/// SHA-1, the second made odd (so that its multiples modulo a layer's size,
/// a power of two, never repeat within a layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UserHash {
    h1: u64,
    h2: u64,
}

impl UserHash {
    pub(super) fn of(user_id: &str) -> Self {
        let digest = Sha1::digest(user_id.as_bytes());
        let word = |i: usize| {
            u64::from(u32::from_be_bytes([
                digest[i],
                digest[i + 1],
                digest[i + 2],
                digest[i + 3],
            ]))
        };
        UserHash {
            h1: word(0),
            h2: word(4) | 1,
        }
    }

    /// The bits this user sets in the layer at bit `offset` of `size` bits.
    fn bits(self, offset: u64, size: u64) -> impl Iterator<Item = u64> {
        (0..HASHES).map(move |j| offset + (self.h1 + j * self.h2) % size)
    }
}

/// Each layer's first bit and size in bits, in order, as far as `bits` reach.
fn layers(bits: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..LAYERS)
        .map(|i| {
            let offset = HEADER_BITS + BASE * BITS * ((1 << i) - 1);
            (offset, (BASE * BITS) << i)
        })
        .take_while(move |(offset, _)| *offset < bits)
}

/// One shard's filter as read from Redis.
#[derive(Debug, Clone)]
pub(super) struct BuyerFilter {
    bytes: Vec<u8>,
}

impl BuyerFilter {
    /// The filter read from the shard's `…:filter` key, if it covers every
    /// buyer: `filter_read.lua` hands it over only when written by a build
    /// (`preload.lua`) and counting exactly the buyers there are. Missing or
    /// without the header (a sale loaded before filters were kept, a key lost
    /// on its own), it cannot gate anyone.
    pub(super) fn read(bytes: Option<Vec<u8>>) -> Option<Self> {
        bytes
            .filter(|b| b.first() == Some(&COMPLETE))
            .map(|bytes| BuyerFilter { bytes })
    }

    fn bit(&self, i: u64) -> bool {
        usize::try_from(i / 8)
            .ok()
            .and_then(|byte| self.bytes.get(byte))
            .is_some_and(|b| b & (0x80 >> (i % 8)) != 0)
    }

    /// Whether the user may be a buyer of this shard: every bit of theirs is set
    /// in some layer. `false` is certain.
    pub(super) fn may_hold(&self, user: UserHash) -> bool {
        let bits = self.bytes.len() as u64 * 8;
        layers(bits).any(|(offset, size)| user.bits(offset, size).all(|b| self.bit(b)))
    }

    /// Bytes held in memory.
    pub(super) fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sets a user's bits as `filter.lua` does for buyer number `n`.
    fn add(bytes: &mut Vec<u8>, n: u64, user: &str) {
        let (mut n, mut layer) = (n, 0);
        let mut all = layers(u64::MAX);
        let (mut offset, mut size) = all.next().expect("layer 0");
        while n >= size / BITS && layer < LAYERS - 1 {
            n -= size / BITS;
            (offset, size) = all.next().expect("a next layer");
            layer += 1;
        }
        for b in UserHash::of(user).bits(offset, size) {
            let byte = usize::try_from(b / 8).expect("small");
            if bytes.len() <= byte {
                bytes.resize(byte + 1, 0);
            }
            bytes[byte] |= 0x80 >> (b % 8);
        }
    }

    /// What Redis answers for `filter.lua` (checked against Redis itself by
    /// `the_lua_side_sets_the_bits_the_rust_side_reads`): `alice` as buyer
    /// number 0 sets bits 545, 943, 1341, 1739, 8936, 9334, 9732 and 10130
    /// (h1 = 1378559850, h2 = 896261945), and `bob` as buyer number 1500
    /// (layer 1, from bit 16424) sets 18596, 23230, 23285, 27919, 32608,
    /// 37297, 41986 and 46675.
    #[test]
    fn hashing_agrees_with_the_lua_side() {
        let alice = UserHash::of("alice");
        assert_eq!(
            alice,
            UserHash {
                h1: 1_378_559_850,
                h2: 896_261_945
            }
        );
        let lua = |n, user| {
            let mut bytes = vec![COMPLETE];
            add(&mut bytes, n, user);
            let mut set: Vec<u64> = (0..bytes.len() as u64 * 8)
                .filter(|&i| i >= HEADER_BITS && bytes[(i / 8) as usize] & (0x80 >> (i % 8)) != 0)
                .collect();
            set.sort_unstable();
            set
        };
        assert_eq!(
            lua(0, "alice"),
            [545, 943, 1341, 1739, 8936, 9334, 9732, 10130]
        );
        assert_eq!(
            lua(1500, "bob"),
            [18596, 23230, 23285, 27919, 32608, 37297, 41986, 46675]
        );
    }

    #[test]
    fn a_buyer_is_never_refused_and_most_others_are() {
        let mut bytes = vec![COMPLETE];
        let buyers = 20_000;
        for n in 0..buyers {
            add(&mut bytes, n, &format!("buyer-{n}"));
        }
        let filter = BuyerFilter::read(Some(bytes)).expect("complete");
        for n in 0..buyers {
            assert!(filter.may_hold(UserHash::of(&format!("buyer-{n}"))), "{n}");
        }
        let others = 100_000;
        let maybe = (0..others)
            .filter(|n| filter.may_hold(UserHash::of(&format!("other-{n}"))))
            .count();
        // Five layers, each under 0.06 % when full.
        assert!(maybe < others / 200, "{maybe} false positives of {others}");
        // 16 bits a buyer, at most twice over for the layer being filled.
        assert!(filter.bytes() <= 2 * 16 / 8 * 20_000 + 5);
    }

    /// `reserve.lua` is run on its own too (the benchmark loads the file), so
    /// it carries `filter.lua` instead of being prefixed with it.
    #[test]
    fn the_reserve_script_carries_the_filter_verbatim() {
        assert!(include_str!("reserve.lua").contains(include_str!("filter.lua")));
    }

    #[test]
    fn a_filter_without_its_header_gates_nobody() {
        assert!(BuyerFilter::read(None).is_none());
        assert!(BuyerFilter::read(Some(vec![0, 0xff])).is_none());
        // The layout before the count of buyers.
        assert!(BuyerFilter::read(Some(vec![1, 0xff])).is_none());
        assert!(BuyerFilter::read(Some(vec![])).is_none());
        assert!(BuyerFilter::read(Some(vec![COMPLETE])).is_some());
    }

    /// `filter.lua` run by Redis itself, as the scripts run it, for buyers
    /// filling layer 0 and part of layer 1: the key it writes is, byte for
    /// byte past the header, what `add` builds, its header counts the buyers,
    /// and `may_hold` finds every one of them.
    #[tokio::test]
    async fn the_lua_side_sets_the_bits_the_rust_side_reads() {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = redis::Client::open(url).expect("a Redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis answers");
        let key = format!("test:filter:{}", uuid::Uuid::new_v4());
        let users: Vec<String> = (0..1_500).map(|n| format!("lua-buyer-{n}")).collect();
        let code = concat!(
            include_str!("filter.lua"),
            r#"
redis.call("SET", KEYS[1], "\2\0\0\0\0")
redis.call("EXPIRE", KEYS[1], 60)
for i, user in ipairs(ARGV) do
  filter_add(KEYS[1], i - 1, user)
end
return redis.call("GET", KEYS[1])
"#
        );
        let from_redis: Vec<u8> = redis::Script::new(code)
            .key(&key)
            .arg(&users)
            .invoke_async(&mut conn)
            .await
            .expect("filter.lua runs");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("DEL");

        let mut from_rust = vec![COMPLETE, 0, 0, 0, 0];
        for (n, user) in users.iter().enumerate() {
            add(&mut from_rust, n as u64, user);
        }
        assert_eq!(
            &from_redis[..5],
            &[COMPLETE, 0, 0, 0x05, 0xdc],
            "1500 buyers"
        );
        assert_eq!(from_redis.len(), from_rust.len());
        assert!(from_redis[5..] == from_rust[5..], "the bits differ");
        let filter = BuyerFilter::read(Some(from_redis)).expect("complete");
        for user in &users {
            assert!(filter.may_hold(UserHash::of(user)), "{user}");
        }
    }
}
