use super::*;

#[test]
fn an_owner_token_is_sixteen_random_bytes_kept_out_of_logs() {
    let (a, b) = (OwnerToken::random(), OwnerToken::random());
    assert_eq!(a.as_bytes().len(), 16);
    assert_ne!(a, b);
    assert_eq!(format!("{a:?}"), "OwnerToken(..)");
}

#[test]
fn errors_say_what_failed_and_keep_their_source() {
    use std::error::Error as _;
    let timeout = StoreError::Timeout(Duration::from_millis(300));
    assert_eq!(timeout.to_string(), "store did not answer within 300ms");
    assert!(timeout.source().is_none());
    let corrupt = StoreError::CorruptRecord("unknown state".to_owned());
    assert_eq!(corrupt.to_string(), "record not written by this layer: unknown state");
    let refused = StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "refused",
    ));
    assert_eq!(refused.to_string(), "store unavailable: refused");
    assert!(refused.source().is_some());
    assert!(refused.is_unavailable());
}

#[test]
fn only_a_record_the_layer_cannot_read_is_available() {
    assert!(!StoreError::CorruptRecord("x".to_owned()).is_unavailable());
    assert!(StoreError::Timeout(Duration::from_secs(1)).is_unavailable());
}
