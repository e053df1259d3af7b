//! `fencegate fence reset`: an operator lowers (or removes) one resource's fence in one store,
//! for recovery when the fence is above every token the authority can issue (a forged token
//! before signing was on, an authority restored from an old backup). Admin only and audited.
//!
//! It is a compare-and-set: the operator names the fence the store's refusals reported, and
//! the store changes it only if it still holds that value. The new fence defaults to the
//! current holder's token (so the holder's writes pass again and no older token does), else the
//! authority's revision; it may never be above the authority's revision, which would brick the
//! resource again.

use std::sync::Arc;

use fencegate_core::{
    now_millis, AuditEvent, AuditSink, FenceReset, OperationSummary, Resource, Store,
};
use serde::Deserialize;
use thiserror::Error;

use crate::authority::Authority;

/// The audit reason of a reset (not a refusal: the metrics of refusals do not count it).
pub const RESET_REASON: &str = "fence_reset";

/// What the operator asks for.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResetRequest {
    pub store: String,
    pub resource: String,
    /// The fence the store holds now (0: none), as its refusals report it.
    pub current: u64,
    /// The new fence (0 removes it); default: the holder's token, else the authority's revision.
    pub to: Option<u64>,
    /// PostgreSQL: a connection string of the fence schema's owner (the node keeps none).
    pub dsn: Option<String>,
    /// S3: the bucket whose manifest-mode log to reset, when several keep one of the resource.
    #[serde(default)]
    pub bucket: Option<String>,
}

#[derive(Debug, Error)]
pub enum ResetError {
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "this node runs no {0} gateway; send the reset to a node whose config has a [{0}] section"
    )]
    NoGateway(Store),
    #[error("the {store} store: {message}")]
    Store { store: Store, message: String },
}

/// The node's side of a reset: the gateways' upstream settings and the audit log.
pub struct FenceResets {
    pub redis: Option<fencegate_redis::RedisConfig>,
    pub s3: Option<fencegate_s3::S3Config>,
    pub audit: Arc<dyn AuditSink>,
}

impl FenceResets {
    /// Resets the fence as `request` asks, on behalf of `caller` (a credential name).
    pub async fn reset(
        &self,
        authority: &Authority,
        request: &ResetRequest,
        caller: &str,
    ) -> Result<FenceReset, ResetError> {
        let store: Store = request
            .store
            .parse()
            .map_err(|e: fencegate_core::UnknownStore| ResetError::BadRequest(e.to_string()))?;
        let resource = Resource::new(&request.resource)
            .map_err(|e| ResetError::BadRequest(format!("resource: {e}")))?;
        let (revision, holder) = authority.fence_floor(&resource).await;
        let to = request.to.unwrap_or(holder.unwrap_or(revision));
        if to > revision {
            return Err(ResetError::BadRequest(format!(
                "to = {to} is above the authority's revision {revision}: no token could pass that fence either; choose a value at most {revision}"
            )));
        }
        let failed = |message: String| ResetError::Store { store, message };
        // Where in the store the fence lives, when the resource alone does not say.
        let mut place = String::new();
        let outcome = match store {
            Store::Redis => {
                let config = self.redis.as_ref().ok_or(ResetError::NoGateway(store))?;
                fencegate_redis::reset_fence(config, &resource, request.current, to)
                    .await
                    .map_err(|e| failed(e.to_string()))?
            }
            Store::Postgres => {
                let dsn = request.dsn.as_deref().ok_or_else(|| {
                    ResetError::BadRequest(
                        "a PostgreSQL reset needs --dsn: a connection string of the fence schema's owner (the role that ran `fencegate postgres install`)".into(),
                    )
                })?;
                let (mut client, connection) = fencegate_postgres::connect::connect(dsn)
                    .await
                    .map_err(|e| failed(e.to_string()))?;
                let outcome =
                    fencegate_postgres::reset_fence(&mut client, &resource, request.current, to)
                        .await
                        .map_err(|e| failed(e.to_string()));
                drop(client);
                connection.abort();
                outcome?
            }
            Store::S3 => {
                let config = self.s3.as_ref().ok_or(ResetError::NoGateway(store))?;
                let bucket = config
                    .reset_bucket(resource.as_str(), request.bucket.as_deref())
                    .map_err(|e| match e {
                        fencegate_s3::S3Error::Config(why) => ResetError::BadRequest(why),
                        e => failed(e.to_string()),
                    })?;
                // A client of its own, without the gateway's cache: the reset is judged on the
                // log as the store holds it.
                let maintenance = fencegate_s3::Maintenance::new(config.clone())
                    .map_err(|e| failed(e.to_string()))?;
                place = format!(" (the manifest log in bucket {bucket})");
                maintenance
                    .reset_fence(&bucket, resource.as_str(), request.current, to)
                    .await
                    .map_err(|e| failed(e.to_string()))?
            }
        };
        if let FenceReset::Done { from, to } = outcome {
            tracing::warn!(%store, resource = %resource, from, to, caller, "fence reset by an operator");
            authority.forget_fences();
            let event = AuditEvent {
                store: store.as_str().to_owned(),
                client_addr: "admin-api".to_owned(),
                client_identity: Some(caller.to_owned()),
                resource: Some(resource.to_string()),
                token: None,
                token_signed: false,
                revision: Some(to),
                fence: Some(from),
                reason: RESET_REASON.to_owned(),
                detail: format!(
                    "the fence of resource {resource}{place} was reset from {from} to {to} by {caller}"
                ),
                operation: OperationSummary {
                    command: "FENCE RESET".to_owned(),
                    objects: vec![resource.to_string()],
                    args: 0,
                    bytes: 0,
                },
                request_id: format!("reset-{}", now_millis()),
            };
            self.audit.refused(event).await.map_err(|e| {
                failed(format!(
                    "the fence was reset but its audit record failed: {e}"
                ))
            })?;
        }
        Ok(outcome)
    }
}
