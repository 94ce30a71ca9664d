//! The fleet's registry ([`Store::announce`]): what a door learns its fleet serves from.

use std::time::Duration;

use crate::{key::RecordKey, store::Store};

/// Each entry is kept for its own time, never shortened by a shorter announcement of it, and
/// listed to every caller until then; a registry is apart from another.
pub async fn the_fleet_registry_keeps_each_entry_for_its_time<St: Store>(store: &St) {
    let registry = RecordKey::new("conformance-fleet", b"", b"registry");
    let other = RecordKey::new("conformance-fleet", b"", b"other");
    let short = Duration::from_millis(300);
    let long = Duration::from_secs(30);
    let entries = [("running:a".to_owned(), short), ("wrote:a".to_owned(), long)];
    let listed = store.announce(&registry, &entries).await.expect("announce");
    let listed = listed.expect("the store keeps a registry (`announce` answered `None`)");
    assert_eq!(sorted(listed), ["running:a", "wrote:a"]);
    // Another instance announces the long one for less: it is kept for its longer time.
    let again = [("wrote:a".to_owned(), Duration::from_millis(100))];
    let listed = store.announce(&registry, &again).await.expect("announce").unwrap_or_default();
    assert_eq!(sorted(listed), ["running:a", "wrote:a"]);
    // Listed to a reader that announces nothing, and not in another registry.
    let read = store.announce(&registry, &[]).await.expect("list").unwrap_or_default();
    assert_eq!(sorted(read), ["running:a", "wrote:a"]);
    let apart = store.announce(&other, &[]).await.expect("list").unwrap_or_default();
    assert!(apart.is_empty(), "another registry lists {apart:?}");
    // Past its time, the short one is gone; the long one stays.
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    let read = store.announce(&registry, &[]).await.expect("list").unwrap_or_default();
    assert_eq!(sorted(read), ["wrote:a"]);
}

fn sorted(mut entries: Vec<String>) -> Vec<String> {
    entries.sort();
    entries
}
