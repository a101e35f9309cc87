//! Where an activity's Redis state lives.
//!
//! An activity with one stock shard (the default) keeps every key under the hash
//! tag `{<activity_id>}`. One split over K shards keeps K complete sets of keys,
//! one per hash tag `{<activity_id>#<k>-<salt>}`, so on a Redis Cluster its
//! reservations spread over up to K primaries:
//! - the salt (the smallest that works) puts shard k's slot in the k-th of K equal
//!   ranges of the 16,384 slots (rotated by the activity's own slot), so with
//!   Redis Cluster's even, contiguous slot ranges K shards on K primaries land one
//!   a primary instead of wherever their hashes fall;
//! - each user has a home shard, a hash of their id, where their purchase right
//!   and their reservation live: the per-user limit is checked in one slot, so it
//!   stays exact whatever K is;
//! - a reservation id names its shard (`<id>.<k>.<K>`), so whoever holds one (the
//!   consumer, the sweeper, the reconciler) finds its keys without knowing the
//!   activity;
//! - a home shard that runs dry borrows units from a sibling (see `lend.lua`).

/// The Redis keys of one shard of an activity.
#[derive(Debug, Clone)]
pub struct Keys {
    /// Which shard (0 for an activity that is not split).
    pub shard: u8,
    pub stock: String,
    pub buyers: String,
    pub pending: String,
    pub res: String,
    pub refunded: String,
    pub state: String,
    pub epoch: String,
    pub barrier: String,
    /// Units this shard lent to siblings: transfer id → "units|to|ms|epoch[|done]"
    /// (written before loans carried the epoch: "units|to|ms[|done]").
    pub lent: String,
    /// Units this shard received from siblings: transfer id → units.
    pub received: String,
    /// Bumped whenever units are added to `stock` (see `reserve.lua`), or a
    /// buyer is adopted (`confirm.lua`).
    pub restock: String,
    /// The buyers' Bloom filter (see `filter.lua`).
    pub filter: String,
    /// The reservation-status views polls cached, with their versions (see
    /// `view_read.lua`).
    pub views: String,
    /// Left, with an expiry, where a finished sale's state was removed: no
    /// build writes the state again (`preload.lua`).
    pub removed: String,
}

impl Keys {
    /// The keys of an activity that is not split (one hash tag).
    pub fn new(activity_id: &str) -> Self {
        Self::with_tag(&format!("{{{activity_id}}}"), 0)
    }

    /// The keys of shard `k` of an activity split over `shards`.
    pub fn shard(activity_id: &str, shards: u8, k: u8) -> Self {
        if shards <= 1 {
            Self::new(activity_id)
        } else {
            Self::with_tag(&format!("{{{}}}", spread_tag(activity_id, shards, k)), k)
        }
    }

    /// The keys of every shard, shard 0 first.
    pub fn all(activity_id: &str, shards: u8) -> Vec<Self> {
        (0..shards.max(1))
            .map(|k| Self::shard(activity_id, shards, k))
            .collect()
    }

    /// The keys of the shard that holds this reservation.
    pub fn of_reservation(activity_id: &str, reservation_id: &str) -> Self {
        let (k, shards) = shard_of(reservation_id);
        Self::shard(activity_id, shards, k)
    }

    /// `reserve.lua`'s KEYS, in its order.
    pub fn reserve_script_keys(&self) -> [&str; 9] {
        [
            &self.stock,
            &self.buyers,
            &self.pending,
            &self.res,
            &self.state,
            &self.received,
            &self.epoch,
            &self.restock,
            &self.filter,
        ]
    }

    fn with_tag(tag: &str, shard: u8) -> Self {
        let base = format!("flash:{tag}");
        Keys {
            shard,
            stock: format!("{base}:stock"),
            buyers: format!("{base}:buyers"),
            pending: format!("{base}:pending"),
            res: format!("{base}:res"),
            refunded: format!("{base}:refunded"),
            state: format!("{base}:state"),
            epoch: format!("{base}:epoch"),
            barrier: format!("{base}:barrier"),
            lent: format!("{base}:lent"),
            received: format!("{base}:received"),
            restock: format!("{base}:restock"),
            filter: format!("{base}:filter"),
            views: format!("{base}:views"),
            removed: format!("{base}:removed"),
        }
    }
}

/// A waiting room's keys (`src/waiting_room`), in the hash tag of the activity's
/// shard 0, so each of its scripts runs in one slot, on a Cluster too.
#[derive(Debug, Clone)]
pub struct RoomKeys {
    /// Users who joined before the start: user → arrival number.
    pub joined: String,
    /// Users who joined at or after the start: user → arrival number.
    pub late: String,
    /// The last arrival number given.
    pub seq: String,
    /// After the draw, users still waiting: user → place (drawn, then late).
    pub queue: String,
    /// Users admitted and not yet settled: user → admitted until (ms).
    pub admitted: String,
    /// Settled turns: user → `reserved`, `expired` or `sold_out`.
    pub outcome: String,
    /// The room's generation (`gen`, set by the join that created it), the
    /// draw (`seed`, `drawn`), `sealed` (no early join counts any more),
    /// `closed`, and the `admitted` and `expired` totals.
    pub meta: String,
    /// Facts not yet copied to MySQL (joins, turns given, settled turns), oldest first,
    /// so that a room Redis lost can be rebuilt without them.
    pub journal: String,
    /// Held by the instance copying the journal to MySQL.
    pub journal_lock: String,
    /// Joiners MySQL is known to have recorded: joining again costs MySQL
    /// nothing for them.
    pub recorded: String,
}

impl RoomKeys {
    pub fn new(activity_id: &str, shards: u8) -> Self {
        let home = Keys::shard(activity_id, shards, 0);
        let base = home
            .stock
            .strip_suffix(":stock")
            .unwrap_or(&home.stock)
            .to_owned();
        let key = |name: &str| format!("{base}:wr:{name}");
        RoomKeys {
            joined: key("joined"),
            late: key("late"),
            seq: key("seq"),
            queue: key("queue"),
            admitted: key("admitted"),
            outcome: key("outcome"),
            meta: key("meta"),
            journal: key("journal"),
            journal_lock: key("journal-lock"),
            recorded: key("recorded"),
        }
    }

    pub fn all(&self) -> [&str; 10] {
        [
            &self.joined,
            &self.late,
            &self.seq,
            &self.queue,
            &self.admitted,
            &self.outcome,
            &self.meta,
            &self.journal,
            &self.journal_lock,
            &self.recorded,
        ]
    }
}

/// The hash tag of shard `k`: `<id>#<k>-<salt>`, whose slot lies in the
/// `(slot(id) / range + k) mod K`-th of K equal slot ranges.
fn spread_tag(activity_id: &str, shards: u8, k: u8) -> String {
    let n = u16::from(shards.max(1));
    let range = SLOTS / n;
    let range_of = |slot: u16| (slot / range).min(n - 1);
    let want = (range_of(key_slot(activity_id)) + u16::from(k)) % n;
    (0..SALT_TRIES)
        .map(|salt| format!("{activity_id}#{k}-{salt}"))
        .find(|tag| range_of(key_slot(tag)) == want)
        .unwrap_or_else(|| format!("{activity_id}#{k}-0"))
}

/// Tries before giving up on placing a shard (each succeeds with chance 1/K).
const SALT_TRIES: u32 = 4096;
const SLOTS: u16 = 16384;

/// Redis Cluster's slot of a key (or tag): CRC16-XMODEM modulo 16,384.
pub fn key_slot(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for b in key.bytes() {
        crc = (crc << 8) ^ CRC16[usize::from((crc >> 8) as u8 ^ b)];
    }
    crc % SLOTS
}

const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// A user's home shard: FNV-1a (64 bits) of their id, modulo the shard count.
/// Stable across instances, builds and platforms.
pub fn home_shard(user_id: &str, shards: u8) -> u8 {
    if shards <= 1 {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in user_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // The remainder is below `shards`, which fits in a u8.
    u8::try_from(h % u64::from(shards)).unwrap_or(0)
}

/// A new reservation id for this user: a time-ordered UUID, followed by the user's
/// home shard when the activity is split.
pub fn new_reservation_id(user_id: &str, shards: u8) -> String {
    let id = uuid::Uuid::now_v7().simple().to_string();
    if shards <= 1 {
        id
    } else {
        format!("{id}.{}.{shards}", home_shard(user_id, shards))
    }
}

/// (shard, shard count) named by a reservation id; `(0, 1)` for one that names
/// none (an activity that is not split).
pub fn shard_of(reservation_id: &str) -> (u8, u8) {
    let mut parts = reservation_id.rsplitn(3, '.');
    let (Some(count), Some(k), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
        return (0, 1);
    };
    match (k.parse::<u8>(), count.parse::<u8>()) {
        (Ok(k), Ok(count)) if k < count => (k, count),
        _ => (0, 1),
    }
}

/// A reservation id as `new_reservation_id` makes them: an id (`[A-Za-z0-9_-]`),
/// optionally followed by `.<k>.<K>` with k < K; 64 characters at most.
pub fn is_valid_reservation_id(reservation_id: &str) -> bool {
    let parts: Vec<&str> = reservation_id.split('.').collect();
    reservation_id.len() <= 64
        && match parts.as_slice() {
            [id] => crate::input::is_valid_id(id),
            [id, _, _] => crate::input::is_valid_id(id) && shard_of(reservation_id).1 > 1,
            _ => false,
        }
}

/// How `available` units are dealt over `shards` at a build: evenly, the first
/// shards one more when it does not divide.
pub fn deal(available: i64, shards: u8) -> Vec<i64> {
    let n = i64::from(shards.max(1));
    let (base, extra) = (available.max(0) / n, available.max(0) % n);
    (0..n).map(|k| base + i64::from(k < extra)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_keeps_the_old_keys() {
        let k = Keys::shard("a1", 1, 0);
        assert_eq!(k.stock, "flash:{a1}:stock");
        assert_eq!(Keys::of_reservation("a1", "0192abcd").stock, k.stock);
        assert_eq!(new_reservation_id("u", 1).len(), 32);
    }

    #[test]
    fn reservations_name_their_shard() {
        for user in ["alice", "bob", "carol", "u-1", "u-2"] {
            let rid = new_reservation_id(user, 3);
            let (k, n) = shard_of(&rid);
            assert_eq!(n, 3);
            assert_eq!(k, home_shard(user, 3));
            let keys = Keys::of_reservation("a1", &rid);
            assert_eq!(keys.stock, Keys::shard("a1", 3, k).stock);
            assert!(keys.stock.starts_with(&format!("flash:{{a1#{k}-")));
        }
        assert!(is_valid_reservation_id("0192abcd.2.3"));
        assert!(is_valid_reservation_id("0192abcd"));
        assert!(!is_valid_reservation_id("0192abcd.3.3"));
        assert!(!is_valid_reservation_id("a.b"));
        assert!(!is_valid_reservation_id(".1.3"));
        assert_eq!(shard_of("x.3.3"), (0, 1));
        assert_eq!(shard_of("x.a.3"), (0, 1));
        assert_eq!(shard_of("plain"), (0, 1));
    }

    #[test]
    fn slots_match_redis() {
        // From the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot("123456789"), 12739);
        assert_eq!(key_slot("foo"), 12182);
    }

    #[test]
    fn shards_fall_in_distinct_slot_ranges() {
        for shards in [2u8, 3, 6, 64] {
            for id in ["a1", "0192f0c4d1b27a3e9c5d", "sale-2026"] {
                let ranges: std::collections::HashSet<u16> = (0..shards)
                    .map(|k| {
                        let tag = spread_tag(id, shards, k);
                        key_slot(&tag) / (SLOTS / u16::from(shards))
                    })
                    .map(|r| r.min(u16::from(shards) - 1))
                    .collect();
                assert_eq!(ranges.len(), usize::from(shards), "{id} over {shards}");
            }
        }
    }

    #[test]
    fn users_spread_over_shards() {
        let mut counts = [0u32; 3];
        for i in 0..3000 {
            counts[usize::from(home_shard(&format!("user-{i}"), 3))] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    #[test]
    fn dealing_conserves_units() {
        assert_eq!(deal(10, 3), vec![4, 3, 3]);
        assert_eq!(deal(2, 3), vec![1, 1, 0]);
        assert_eq!(deal(7, 1), vec![7]);
        assert_eq!(deal(100, 64).iter().sum::<i64>(), 100);
    }
}
