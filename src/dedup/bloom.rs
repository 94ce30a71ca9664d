//! The Bloom strategy's arithmetic: a filter's size for a load and a false-positive rate, the
//! rate a size gives at a load, and an event's bit positions (double hashing over its SHA-256).

/// The largest filter: Redis holds at most 512 MiB in one string.
pub(super) const MAX_BITS: u64 = 1 << 32;

/// The most bits one event sets: past 30 the rate gained is below any load's noise.
pub(super) const MAX_HASHES: u32 = 30;

/// The optimal size for `events` at `rate`: bits `m = -n ln p / (ln 2)²`, hashes
/// `k = (m / n) ln 2`.
pub(super) fn size(events: u64, rate: f64) -> (u64, u32) {
    let events = events.max(1) as f64;
    let bits = (-events * rate.ln() / (std::f64::consts::LN_2 * std::f64::consts::LN_2)).ceil();
    let hashes = (bits / events * std::f64::consts::LN_2).round();
    // Saturating casts: the caller refuses a size over MAX_BITS.
    (bits.max(64.0) as u64, (hashes as u32).clamp(1, MAX_HASHES))
}

/// The false-positive rate of a filter of `bits` and `hashes` holding `events`:
/// `(1 - e^(-k n / m))^k`.
pub(super) fn rate(bits: u64, hashes: u32, events: f64) -> f64 {
    let hashes = f64::from(hashes);
    (1.0 - (-hashes * events / bits as f64).exp()).powf(hashes)
}

/// Appends the `hashes` bit positions of the event whose hash is `hash` in a filter of `bits`:
/// `h1 + i h2 mod m` (Kirsch and Mitzenmacher), from two 64-bit words of the hash that the
/// shard does not use.
pub(super) fn positions(hash: &[u8; 32], bits: u64, hashes: u32, into: &mut Vec<u64>) {
    let word = |at: usize| {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(&hash[at..at + 8]);
        u128::from(u64::from_be_bytes(bytes))
    };
    let (h1, h2) = (word(16), word(24) | 1);
    let bits = u128::from(bits.max(1));
    // Below `bits`, which is a u64.
    into.extend((0..u128::from(hashes)).map(|i| ((h1 + i * h2) % bits) as u64));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_for_a_load_and_rate_is_the_textbook_one() {
        // 9.585 bits and 7 hashes an event at 1 %; 14.38 bits and 10 hashes at 0.1 %.
        assert_eq!(size(1_000_000, 0.01), (9_585_059, 7));
        assert_eq!(size(1_000_000, 0.001), (14_377_588, 10));
        let at_design = rate(9_585_059, 7, 1_000_000.0);
        assert!((at_design - 0.01).abs() < 0.0005, "{at_design}");
        // Twice the load it was sized for: about 16 %.
        let doubled = rate(9_585_059, 7, 2_000_000.0);
        assert!((0.15..0.17).contains(&doubled), "{doubled}");
        assert_eq!(size(0, 0.5).0, 64, "never below a word");
    }

    #[test]
    fn positions_are_below_the_size_distinct_and_from_the_unsharded_words() {
        let mut hash = [0xff; 32];
        let mut into = Vec::new();
        positions(&hash, 1_000, 7, &mut into);
        assert_eq!(into.len(), 7);
        assert!(into.iter().all(|bit| *bit < 1_000));
        let distinct: std::collections::HashSet<_> = into.iter().collect();
        assert_eq!(distinct.len(), 7, "{into:?}");
        // The shard's bytes (the first two) leave the positions as they are.
        hash[0] = 0;
        hash[1] = 0;
        let mut again = Vec::new();
        positions(&hash, 1_000, 7, &mut again);
        assert_eq!(into, again);
        hash[20] = 0;
        let mut other = Vec::new();
        positions(&hash, 1_000, 7, &mut other);
        assert_ne!(into, other);
    }

    #[test]
    fn a_second_word_of_zero_or_one_still_spreads_the_bits() {
        // The step is made odd: a step of zero would put every bit in one place.
        for last in [0, 1] {
            let mut hash = [0; 32];
            hash[31] = last;
            let mut into = Vec::new();
            positions(&hash, 1_000, 7, &mut into);
            let distinct: std::collections::HashSet<_> = into.iter().collect();
            assert_eq!(distinct.len(), 7, "{into:?}");
        }
    }
}
