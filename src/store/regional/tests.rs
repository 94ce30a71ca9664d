//! The routing of `RegionalStore`: which region each key's calls go to.

use super::*;
use crate::store::{Admin, MemoryStore};

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
    // The rule depends on the key and the names alone: a fixed key has a fixed home, in
    // every process: the name whose SHA-256 of (its length, itself, the key's hash) is highest.
    let fixed = RecordKey::new("idempotency", b"", b"order-1");
    let score = |name: &str| {
        use sha2::{Digest, Sha256};
        let mut bytes = (name.len() as u64).to_be_bytes().to_vec();
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(fixed.hash().as_bytes());
        u64::from_be_bytes(Sha256::digest(&bytes)[..8].try_into().unwrap())
    };
    let expected = ["eu", "us", "ap"].into_iter().max_by_key(|name| score(name)).unwrap();
    assert_eq!(store.home_of(&fixed), expected);
}

#[test]
fn the_hashed_home_depends_on_the_names_not_their_order_and_a_new_region_moves_few_keys() {
    let (store, reordered) = (
        three(),
        RegionalStore::new([
            ("ap", MemoryStore::new()),
            ("eu", MemoryStore::new()),
            ("us", MemoryStore::new()),
        ]),
    );
    let four = RegionalStore::new([
        ("eu", MemoryStore::new()),
        ("us", MemoryStore::new()),
        ("ap", MemoryStore::new()),
        ("sa", MemoryStore::new()),
    ]);
    let mut moved = 0;
    for i in 0..3000 {
        let key = RecordKey::new("idempotency", b"", format!("order-{i}").as_bytes());
        assert_eq!(store.home_of(&key), reordered.home_of(&key), "order-{i}");
        let now = four.home_of(&key);
        if now != store.home_of(&key) {
            // A key moves only to the new region.
            assert_eq!(now, "sa", "order-{i}");
            moved += 1;
        }
    }
    assert!((600..900).contains(&moved), "{moved} of 3000 keys moved");
}

#[test]
#[should_panic(expected = "two regions are named \"eu\"")]
fn two_regions_of_one_name_are_refused() {
    let _ = RegionalStore::new([("eu", MemoryStore::new()), ("eu", MemoryStore::new())]);
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
    let store = three().home(|_: &RecordKey, regions: &[String]| regions.len() + 1);
    assert_eq!(store.home_of(&RecordKey::new("t", b"", b"k")), "us");
    assert_eq!(store.regions().collect::<Vec<_>>(), ["eu", "us", "ap"]);
    assert!(format!("{store:?}").contains("\"eu\""));
}
