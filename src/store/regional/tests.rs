//! The routing of `RegionalStore`: which region each key's calls go to.

use super::*;
use crate::store::MemoryStore;

fn three() -> RegionalStore<MemoryStore> {
    RegionalStore::new([
        ("eu", MemoryStore::new()),
        ("us", MemoryStore::new()),
        ("ap", MemoryStore::new()),
    ])
}

#[test]
fn the_hashed_home_spreads_keys_over_every_region_and_never_moves_one() {
    let store = three();
    let mut homes = std::collections::HashMap::<&str, usize>::new();
    for i in 0..3000 {
        let key = RecordKey::new("idempotency", b"", format!("order-{i}").as_bytes());
        let home = store.home_of(&key);
        assert_eq!(home, store.clone().home_of(&key), "one key, two homes");
        *homes.entry(home).or_default() += 1;
    }
    for region in ["eu", "us", "ap"] {
        let share = homes[region];
        assert!((800..1200).contains(&share), "{region} homes {share} of 3000 keys");
    }
    // The rule depends on the key alone: a fixed key has a fixed home, in every process.
    let fixed = RecordKey::new("idempotency", b"", b"order-1");
    let expected = ["eu", "us", "ap"]
        [usize::try_from(u64::from_str_radix(&fixed.hash()[..16], 16).unwrap() % 3).unwrap()];
    assert_eq!(store.home_of(&fixed), expected);
}

#[tokio::test]
async fn every_transition_of_a_key_lands_in_its_home_alone() {
    let store = three();
    let fingerprint = Fingerprint::new("POST", "/", "", b"1");
    let long = Duration::from_secs(60);
    for i in 0..30 {
        let key = RecordKey::new("t", b"", format!("k{i}").as_bytes());
        let owner = OwnerToken::random();
        assert_eq!(
            store.claim(&key, &fingerprint, &owner, long.into()).await.unwrap(),
            Claim::Claimed
        );
        let done = store.complete(&key, &owner, &fingerprint, Bytes::from_static(b"r"), long);
        assert_eq!(done.await.unwrap(), Fenced::Applied);
        for name in ["eu", "us", "ap"] {
            let held = store.region(name).unwrap().inspect(&key, false).await.unwrap();
            assert_eq!(held.is_some(), name == store.home_of(&key), "{name} for k{i}");
        }
    }
}

#[test]
fn a_rule_past_the_last_region_wraps_around() {
    let store = three().home(|_: &RecordKey, regions: usize| regions + 1);
    assert_eq!(store.home_of(&RecordKey::new("t", b"", b"k")), "us");
    assert_eq!(store.regions().collect::<Vec<_>>(), ["eu", "us", "ap"]);
    assert!(format!("{store:?}").contains("\"eu\""));
}
