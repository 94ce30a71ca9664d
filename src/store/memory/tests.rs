use super::*;

#[tokio::test]
async fn expired_records_are_swept_out() {
    let store = MemoryStore::new();
    let fingerprint = Fingerprint::new("POST", "/", "", b"");
    let claim = |i: usize, lease: Duration| {
        let store = store.clone();
        let fingerprint = fingerprint.clone();
        async move {
            let key = RecordKey::new("t", b"", i.to_string().as_bytes());
            store.claim(&key, &fingerprint, &OwnerToken::random(), lease.into()).await.unwrap()
        }
    };
    for i in 0..SWEEP_FROM {
        assert_eq!(claim(i, Duration::from_millis(1)).await, Claim::Claimed);
    }
    std::thread::sleep(Duration::from_millis(5));
    // The next claim finds the map at the mark and sweeps the expired records out.
    claim(SWEEP_FROM, Duration::from_secs(60)).await;
    assert_eq!(store.lock().map.len(), 1);
    assert_eq!(store.lock().sweep_at, SWEEP_FROM);
    assert_eq!(store.len(), 1);
}

#[tokio::test]
async fn len_and_is_empty_count_live_records_only() {
    let store = MemoryStore::new();
    assert!(store.is_empty());
    claim_many(&store, "short", 2, Duration::from_millis(1)).await;
    claim_many(&store, "long", 1, Duration::from_secs(60)).await;
    assert!(!store.is_empty());
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(store.len(), 1);
}

#[tokio::test]
async fn a_full_store_refuses_new_claims_and_evicts_nothing() {
    let store = MemoryStore::with_capacity(3);
    let long = Duration::from_secs(60);
    let fingerprint = Fingerprint::new("POST", "/", "", b"");
    let done = RecordKey::new("t", b"", b"done");
    let owner = OwnerToken::random();
    store.claim(&done, &fingerprint, &owner, long.into()).await.unwrap();
    store.complete(&done, &owner, &fingerprint, Bytes::from_static(b"r"), long).await.unwrap();
    claim_many(&store, "live", 2, long).await;
    let extra = RecordKey::new("t", b"", b"extra");
    let full = store.claim(&extra, &fingerprint, &OwnerToken::random(), long.into()).await;
    assert!(matches!(full, Err(StoreError::CapacityReached(3))), "{full:?}");
    assert!(full.unwrap_err().is_unavailable());
    // Everything already there is still there: replays and claims answer as before.
    let replay =
        store.claim(&done, &fingerprint, &OwnerToken::random(), long.into()).await.unwrap();
    assert!(matches!(replay, Claim::Replay { response, .. } if response == "r"));
    assert_eq!(store.len(), 3);
    // Room made by expiry is used.
    let short = MemoryStore::with_capacity(1);
    claim_many(&short, "short", 1, Duration::from_millis(1)).await;
    std::thread::sleep(Duration::from_millis(5));
    claim_many(&short, "next", 1, long).await;
    assert_eq!(short.len(), 1);
}

/// Claims `n` keys named `{prefix}{i}` for `lease`.
async fn claim_many(store: &MemoryStore, prefix: &str, n: usize, lease: Duration) {
    let fingerprint = Fingerprint::new("POST", "/", "", b"");
    for i in 0..n {
        let key = RecordKey::new("t", b"", format!("{prefix}{i}").as_bytes());
        let claim = store.claim(&key, &fingerprint, &OwnerToken::random(), lease.into()).await;
        assert_eq!(claim.unwrap(), Claim::Claimed);
    }
}

#[tokio::test]
async fn a_sweep_keeps_live_claims_and_completed_records() {
    let store = MemoryStore::new();
    let fingerprint = Fingerprint::new("POST", "/", "", b"");
    let done = RecordKey::new("t", b"", b"done");
    let owner = OwnerToken::random();
    let long = Duration::from_secs(60);
    store.claim(&done, &fingerprint, &owner, long.into()).await.unwrap();
    let response = Bytes::from_static(b"stored");
    store.complete(&done, &owner, &fingerprint, response.clone(), long).await.unwrap();
    // Past the mark: the map is swept with every record still live.
    claim_many(&store, "live", SWEEP_FROM + 100, long).await;
    assert_eq!(store.lock().map.len(), SWEEP_FROM + 101);
    assert_eq!(store.len(), SWEEP_FROM + 101);
    let replay =
        store.claim(&done, &fingerprint, &OwnerToken::random(), long.into()).await.unwrap();
    assert!(matches!(replay, Claim::Replay { response: r, .. } if r == response));
    let live = RecordKey::new("t", b"", b"live7");
    let probe = store.claim(&live, &fingerprint, &OwnerToken::random(), long.into()).await.unwrap();
    assert!(matches!(probe, Claim::InProgress { .. }), "{probe:?}");
    // The mark moved to twice what the sweep kept.
    assert_eq!(store.lock().sweep_at, 2 * SWEEP_FROM);
}

#[tokio::test]
async fn the_sweep_runs_again_once_the_map_reaches_its_new_mark() {
    let store = MemoryStore::new();
    let long = Duration::from_secs(60);
    // Live records move the mark up to 2 * SWEEP_FROM.
    claim_many(&store, "live", SWEEP_FROM + 1, long).await;
    assert_eq!(store.lock().sweep_at, 2 * SWEEP_FROM);
    // Short claims fill the map up to the new mark, then lapse.
    claim_many(&store, "short", SWEEP_FROM - 1, Duration::from_millis(1)).await;
    assert_eq!(store.lock().map.len(), 2 * SWEEP_FROM);
    std::thread::sleep(Duration::from_millis(5));
    claim_many(&store, "next", 1, long).await;
    // The expired ones went; the live ones stayed.
    assert_eq!(store.lock().map.len(), SWEEP_FROM + 2);
    assert_eq!(store.len(), SWEEP_FROM + 2);
}
