//! The commit slot's stages and what a transaction's failure says.

use std::sync::Arc;

use super::{slot::Running, *};

#[test]
fn a_claim_commits_once_and_begins_again_only_after_a_roll_back() {
    let slot = Arc::new(CommitSlot::default());
    assert!(slot.outcome().is_none() && !slot.begun());
    slot.start(true).unwrap();
    assert!(slot.holds_record());
    assert!(slot.start(true).is_err(), "a nested transaction began");
    drop(Running::new(slot.clone()));
    assert!(matches!(slot.outcome(), Some(Commit::RolledBack)));
    assert!(!slot.holds_record());
    slot.start(false).unwrap();
    assert!(!slot.holds_record());
    let mut running = Running::new(slot.clone());
    running.committing();
    drop(running);
    assert!(matches!(slot.outcome(), Some(Commit::Unknown)));
    assert!(slot.start(true).is_err(), "a transaction began after an unknown commit");
    let slot = Arc::new(CommitSlot::default());
    slot.start(true).unwrap();
    Running::new(slot.clone()).end_with(Commit::Committed(Bytes::from_static(b"r")));
    assert!(slot.start(true).is_err(), "a transaction began after a commit");
    assert!(matches!(slot.outcome(), Some(Commit::Committed(_))));
}

/// An outcome not stored says so once, in its `Display` and in what a door answers (the
/// encoder's sentence is carried whole).
#[test]
fn an_outcome_not_stored_says_so_once() {
    let reason = EncodeError::NotStored("the store policy does not keep it").to_string();
    let error = TransactionError::<String>::NotStored(reason);
    let said = "the outcome is not stored: the store policy does not keep it";
    assert_eq!(error.to_string(), format!("rolled back: {said}"));
    match error.failure() {
        Failure::Handler(Some(detail)) => assert_eq!(detail, said),
        other => panic!("{other:?}"),
    }
    let store = TransactionError::<String>::Store(StoreError::FencedOut);
    assert_eq!(store.to_string(), format!("rolled back: {}", StoreError::FencedOut));
    assert!(
        matches!(store.failure(), Failure::Store(detail) if detail.starts_with("rolled back: "))
    );
}
