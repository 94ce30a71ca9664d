//! The negative control's store: every call made with one owner token, so that no fence tells
//! a lapsed holder from the new owner. A run over it must show double executions, or the checker
//! proves nothing (`--unfenced --expect-violations`).

use std::{sync::LazyLock, time::Duration};

use axum_idempotency::Fingerprint;
use axum_idempotency::store::{
    Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription,
};
use bytes::Bytes;

/// The one token every holder's calls carry.
static ONE_TOKEN: LazyLock<OwnerToken> = LazyLock::new(OwnerToken::random);

/// `St`, with its owner-token fence defeated.
#[derive(Clone)]
pub(crate) struct Unfenced<St>(pub(crate) St);

impl<St: Store> Store for Unfenced<St> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        _owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.0.claim(key, fingerprint, &ONE_TOKEN, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        _owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.0.complete(key, &ONE_TOKEN, fingerprint, response, retention).await
    }

    async fn release(&self, key: &RecordKey, _owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.0.release(key, &ONE_TOKEN).await
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        _owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.0.claim_waiting(key, fingerprint, &ONE_TOKEN, lease).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.0.subscribe(key).await
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        _owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.0.abandon(key, &ONE_TOKEN, fingerprint, lease).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        _owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.0.touch(key, &ONE_TOKEN, lease).await
    }
}
