//! Tokens this process has verified in full, with their subject and expiry, so
//! a user's next click costs one SHA-256 of the token and one hash lookup
//! instead of a signature check and two JSON parses (the cache of verified JWTs
//! API gateways keep), whatever algorithm verified the token first.
//!
//! Only a token that passed every check enters; a hit checks the expiry again.
//! The key is the token's SHA-256, not the token: an identity provider's RS256
//! token runs to a kilobyte, and a million remembered ones would hold a
//! gigabyte; a digest holds 32 bytes, and SHA-256 keeps two tokens from ever
//! sharing an entry. Bounded: emptied when full, and emptied when the identity
//! provider withdraws a key (a token it signed is then verified again, and
//! refused).
//!
//! Memory: an entry is the 32-byte digest, the user id (an `Arc<str>`: 16
//! bytes, and a heap block of 16 bytes + the id) and the expiry
//! (8 bytes), in a table that keeps up to 1/8 of its slots free and doubles as
//! it grows: at most about 170 bytes an entry (docs/DESIGN.md, measured).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::User;

pub(super) struct Verified {
    capacity: usize,
    tokens: Mutex<Tokens>,
    /// Tokens verified in full (not answered from here): the hits are the
    /// requests this number did not count.
    full_checks: AtomicU64,
}

struct Tokens {
    /// SHA-256 of the token → its user.
    map: HashMap<[u8; 32], VerifiedUser>,
    /// Bumped by every `clear`: a token verified before a clear (perhaps with
    /// a key withdrawn since) is not remembered after it.
    generation: u64,
}

/// A verified token's user id and expiry (seconds since the epoch).
type VerifiedUser = (Arc<str>, i64);

fn digest(token: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    key.copy_from_slice(&Sha256::digest(token.as_bytes()));
    key
}

impl Verified {
    /// Keeps at most `capacity` tokens; 0 keeps none.
    pub(super) fn new(capacity: usize) -> Self {
        Verified {
            capacity,
            tokens: Mutex::new(Tokens {
                map: HashMap::new(),
                generation: 0,
            }),
            full_checks: AtomicU64::new(0),
        }
    }

    /// Read before a token is verified in full and handed to `put`: the token
    /// is remembered only if no `clear` came in between.
    pub(super) fn generation(&self) -> u64 {
        self.full_checks.fetch_add(1, Ordering::Relaxed);
        self.lock().generation
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tokens> {
        // A poisoned lock only means a thread panicked between two statements
        // of `put`/`clear`, each of which leaves the map whole.
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The user of a token verified before and not expired at `oldest_exp`.
    pub(super) fn get(&self, token: &str, oldest_exp: i64) -> Option<User> {
        if self.capacity == 0 {
            return None;
        }
        let key = digest(token);
        let tokens = self.lock();
        match tokens.map.get(&key) {
            Some((id, exp)) if *exp >= oldest_exp => Some(User { id: id.clone() }),
            _ => None,
        }
    }

    /// Remembers a token verified in full since [`Verified::generation`]
    /// returned `generation`; nothing when a `clear` came in between.
    pub(super) fn put(&self, token: &str, user: &User, exp: i64, generation: u64) {
        if self.capacity == 0 {
            return;
        }
        let key = digest(token);
        let full = {
            let mut tokens = self.lock();
            if tokens.generation != generation {
                return;
            }
            let full = if tokens.map.len() >= self.capacity {
                Some(std::mem::take(&mut tokens.map))
            } else {
                None
            };
            tokens.map.insert(key, (user.id.clone(), exp));
            full
        };
        // The full map's entries are freed here, with no request waiting on
        // the lock meanwhile.
        drop(full);
    }

    /// Forgets every token (a key they may have been verified with is gone),
    /// and every token being verified now.
    pub(super) fn clear(&self) {
        let old = {
            let mut tokens = self.lock();
            tokens.generation += 1;
            std::mem::take(&mut tokens.map)
        };
        drop(old);
    }

    /// Tokens verified in full so far.
    #[cfg(test)]
    pub(super) fn full_checks(&self) -> u64 {
        self.full_checks.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().map.len()
    }
}
