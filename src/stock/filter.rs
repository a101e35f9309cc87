//! The buyers' filter, read side: a Bloom filter of a shard's buyers that the
//! scripts recording a buyer keep in Redis (`filter.lua`, prefixed to
//! `reserve.lua`, `preload.lua` and `confirm.lua`), read once when a sold-out
//! gate shuts. It answers "certainly not a buyer" or "maybe"; a maybe goes to
//! Redis, which answers exactly. A buyer is never "certainly not": every script
//! that writes `buyers` sets the buyer's bits in the same atomic step.
//!
//! The layout and the hashing are `filter.lua`'s, constant for constant.

use sha1::{Digest, Sha1};

/// Bits before the first layer: the header byte.
const HEADER_BITS: u64 = 8;
/// Buyers in layer 0; each next layer holds twice as many.
const BASE: u64 = 1024;
/// Bits per buyer in every layer.
const BITS: u64 = 16;
/// Bits each buyer sets in its layer.
const HASHES: u64 = 8;
/// Layers at most; the last one takes every buyer past the others.
const LAYERS: u32 = 16;
/// The header of a filter that covers every buyer of its build.
const COMPLETE: u8 = 1;

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
    /// buyer: written by a build (`preload.lua`), its header says so. Missing or
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

    /// What Redis answers for `filter.lua` (checked with `redis-cli EVAL`):
    /// `alice` as buyer number 0 sets bits 513, 911, 1309, 1707, 8904, 9302,
    /// 9700 and 10098 (h1 = 1378559850, h2 = 896261945), and `bob` as buyer
    /// number 1500 (layer 1, from bit 16392) sets 18564, 23198, 23253, 27887,
    /// 32576, 37265, 41954 and 46643.
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
                .filter(|&i| i >= 8 && bytes[(i / 8) as usize] & (0x80 >> (i % 8)) != 0)
                .collect();
            set.sort_unstable();
            set
        };
        assert_eq!(
            lua(0, "alice"),
            [513, 911, 1309, 1707, 8904, 9302, 9700, 10098]
        );
        assert_eq!(
            lua(1500, "bob"),
            [18564, 23198, 23253, 27887, 32576, 37265, 41954, 46643]
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
        assert!(filter.bytes() <= 2 * 16 / 8 * 20_000 + 1);
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
        assert!(BuyerFilter::read(Some(vec![])).is_none());
        assert!(BuyerFilter::read(Some(vec![COMPLETE])).is_some());
    }
}
