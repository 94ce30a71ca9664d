//! The fleet's registry ([`Store::announce`]) over a store per region: announced in each,
//! each recording its region's name.

use std::time::Duration;

use crate::{
    key::RecordKey,
    store::{OwnerToken, Store, StoreError},
};

/// In every region's store (each keeps the records of the keys whose home it is): every
/// entry any of them lists; `None` when none keeps a registry. A region that cannot be
/// reached is left out (its keys' claims fail on their own), unless none can.
///
/// Each region's store records the region's name too (`region:`, for as long as the
/// longest entry): a store that records another region's name (two names for one store, a
/// URL that points at another region's store) is refused, [`StoreError::Misplaced`]: its
/// keys would have two homes.
pub(super) async fn announce<St: Store>(
    regions: &[(String, St)],
    registry: &RecordKey,
    entries: &[(String, Duration)],
) -> Result<Option<Vec<String>>, StoreError> {
    let mut listed: Option<Vec<String>> = None;
    let mut failed = None;
    let lasts = entries.iter().map(|(_, lasts)| *lasts).max();
    for (region, store) in regions {
        let mut named = entries.to_vec();
        named.extend(lasts.map(|lasts| (format!("region:{region}"), lasts)));
        match store.announce(registry, &named).await {
            Ok(Some(mut entries)) => {
                let other = entries
                    .iter()
                    .filter_map(|entry| entry.strip_prefix("region:"))
                    .find(|name| name != region);
                if let Some(other) = other {
                    return Err(StoreError::Misplaced(format!(
                        "the store this instance names region `{region}` records itself as \
                         region `{other}`'s: one store under two names (a URL that points at \
                         another region's store, or a region renamed while its records \
                         live), whose keys would have two homes"
                    )));
                }
                entries
                    .retain(|entry| !entry.starts_with("region:") && !entry.starts_with("probe:"));
                listed.get_or_insert_with(Vec::new).extend(entries);
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(region, %error, "idempotency: a region's store could not list its fleet");
                failed = Some(error);
            }
        }
    }
    if let (None, Some(error)) = (&listed, failed) {
        return Err(error);
    }
    Ok(listed.map(|mut listed| {
        listed.sort();
        listed.dedup();
        listed
    }))
}

/// Whether `a` and `b` are one store: an entry of its own announced through `a` (for a second)
/// is listed through `b`. Two stores that keep no registry cannot be told apart, and count as
/// one.
pub(super) async fn one_store<St: Store>(
    a: &St,
    b: &St,
    registry: &RecordKey,
) -> Result<bool, StoreError> {
    let token = OwnerToken::random();
    let probe: String = token.as_bytes().iter().map(|byte| format!("{byte:02x}")).collect();
    let probe = format!("probe:{probe}");
    if a.announce(registry, &[(probe.clone(), Duration::from_secs(1))]).await?.is_none() {
        return Ok(true);
    }
    Ok(b.announce(registry, &[]).await?.is_none_or(|listed| listed.contains(&probe)))
}
