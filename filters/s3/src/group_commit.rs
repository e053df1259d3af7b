//! Manifest mode, group commit: concurrent commits into one resource's log from this node
//! share one log entry. Each commit queues its change, then waits for the resource's leader
//! lock; whoever holds it first lingers while this node still has buffered physical writes of
//! the resource under way (they are about to queue; bounded by [`GROUP_LINGER`]), then takes
//! every queued change, plans them in order over the view ([`crate::manifest::Batch`]: a stale
//! token is refused, the others raise the fence and apply) and appends the result as one entry
//! with `If-None-Match: *` on the next position. Answers are given only after that write
//! succeeds, and a refusal planned on the cached view is planned again on the re-read log
//! tail, so a refusal always rests on a fence the store holds now. One node therefore sends at
//! most one log append per resource at a time; other nodes race for positions through
//! `If-None-Match`, and the loser catches up and re-plans.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_core::{Rejection, Store, Token};
use tokio::sync::{oneshot, Notify};

use crate::error::S3Error;
use crate::gateway::Shared;
use crate::manifest::{Batch, Change, CommitPlan};
use crate::rewrite::ClientConditions;

/// The longest a leader waits for this node's physical writes under way to join its batch. A
/// write that takes longer joins the next batch; a write is counted only once its body is
/// buffered, so only store latency is waited for, never a slow client.
pub(crate) const GROUP_LINGER: Duration = Duration::from_millis(50);

/// How a commit ended.
#[derive(Debug, Clone)]
pub(crate) enum CommitDone {
    Committed,
    Refused(Rejection),
    PreconditionFailed,
    NoSuchKey,
    Busy,
}

/// One change waiting for a commit.
pub(crate) struct Pending {
    pub(crate) token: Token,
    pub(crate) target: String,
    pub(crate) change: Change,
    pub(crate) conditions: ClientConditions,
    reply: oneshot::Sender<Result<CommitDone, String>>,
}

/// The queue and leader lock of one resource's log.
#[derive(Default)]
pub(crate) struct Committer {
    queue: Mutex<Vec<Pending>>,
    leader: tokio::sync::Mutex<()>,
    /// Buffered physical writes under way that will queue a change.
    writing: AtomicUsize,
    /// Woken when one of them queues (or gives up).
    arrived: Notify,
    /// A checkpoint is being written.
    checkpointing: AtomicBool,
}

/// A physical write under way that the next batch should wait for (see [`GROUP_LINGER`]);
/// dropping it (queued, or failed) stops the wait.
pub(crate) struct Writing(Arc<Committer>);

impl Drop for Writing {
    fn drop(&mut self) {
        self.0.writing.fetch_sub(1, Ordering::AcqRel);
        self.0.arrived.notify_waiters();
    }
}

impl Shared {
    fn committer(&self, bucket: &str, resource: &str) -> Arc<Committer> {
        // One entry per manifest-mode rule's (bucket, resource): bounded by the config.
        self.committers
            .lock()
            .expect("poisoned")
            .entry((bucket.to_owned(), resource.to_owned()))
            .or_default()
            .clone()
    }

    /// Announces a physical write of `resource` whose change will be committed next.
    pub(crate) fn writing(&self, bucket: &str, resource: &str) -> Writing {
        let committer = self.committer(bucket, resource);
        committer.writing.fetch_add(1, Ordering::AcqRel);
        Writing(committer)
    }

    /// Commits `change` into the log of `resource`, together with whatever else is queued
    /// for it. `writing` is this change's announcement, released once it is queued.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn commit_grouped(
        &self,
        bucket: &str,
        resource: &str,
        token: &Token,
        target: String,
        change: Change,
        conditions: ClientConditions,
        writing: Option<Writing>,
    ) -> Result<CommitDone, S3Error> {
        let committer = self.committer(bucket, resource);
        let (reply, mut answer) = oneshot::channel();
        committer.queue.lock().expect("poisoned").push(Pending {
            token: token.clone(),
            target,
            change,
            conditions,
            reply,
        });
        drop(writing);
        let leader = committer.leader.lock().await;
        // An earlier leader may have committed this change already.
        if let Ok(done) = answer.try_recv() {
            return done.map_err(S3Error::Upstream);
        }
        linger(&committer).await;
        let batch = std::mem::take(&mut *committer.queue.lock().expect("poisoned"));
        self.commit_batch(bucket, resource, batch).await;
        drop(leader);
        if !committer.checkpointing.swap(true, Ordering::AcqRel) {
            self.checkpoint_if_due(bucket, resource).await;
            committer.checkpointing.store(false, Ordering::Release);
        }
        answer
            .await
            .map_err(|_| S3Error::Upstream("the commit was abandoned; retry".into()))?
            .map_err(S3Error::Upstream)
    }

    async fn commit_batch(&self, bucket: &str, resource: &str, batch: Vec<Pending>) {
        let mut revalidate = false;
        for _attempt in 0..self.config.max_attempts {
            let current = match self.manifest(bucket, resource, revalidate).await {
                Ok(current) => current,
                Err(e) => return answer_all(batch, |_| Err(e.to_string())),
            };
            let empty = crate::manifest::Manifest::default();
            let base = current.as_ref().map_or(&empty, |l| &*l.manifest);
            let position = base.position + 1;
            let mut planned = Batch::new(base).issued(self.policy.issued.get());
            let mut decided = Vec::with_capacity(batch.len());
            let mut recheck = false;
            for pending in &batch {
                let plan = planned.plan(
                    &pending.token,
                    &pending.target,
                    &pending.change,
                    &pending.conditions,
                );
                decided.push(match plan {
                    // A refusal or a client precondition judged on a cached view is checked on
                    // a fresh one: an operator's reset may have lowered the fence since.
                    CommitPlan::Refuse(_)
                    | CommitPlan::PreconditionFailed
                    | CommitPlan::NoSuchKey
                        if !revalidate =>
                    {
                        recheck = true;
                        break;
                    }
                    CommitPlan::Refuse(rejection) => CommitDone::Refused(rejection),
                    CommitPlan::PreconditionFailed => CommitDone::PreconditionFailed,
                    CommitPlan::NoSuchKey => CommitDone::NoSuchKey,
                    CommitPlan::Commit => CommitDone::Committed,
                });
            }
            if recheck {
                revalidate = true;
                continue;
            }
            let Some(entry) = planned.into_entry() else {
                return answer_each(batch, decided);
            };
            // The view is not needed past planning: dropping it lets the append update the
            // cached view in place.
            drop(current);
            match self.append(bucket, resource, position, &entry).await {
                Ok(Some(_)) => {
                    for done in &decided {
                        if matches!(done, CommitDone::Committed) {
                            self.audit.applied(Store::S3);
                        }
                    }
                    return answer_each(batch, decided);
                }
                Ok(None) => revalidate = true,
                Err(e) => return answer_all(batch, |_| Err(e.to_string())),
            }
        }
        answer_all(batch, |_| Ok(CommitDone::Busy))
    }
}

/// Waits, at most [`GROUP_LINGER`], until no announced physical write is still under way.
async fn linger(committer: &Committer) {
    let deadline = tokio::time::Instant::now() + GROUP_LINGER;
    loop {
        // Registered before the count is read, so a drop in between still wakes it.
        let arrived = committer.arrived.notified();
        if committer.writing.load(Ordering::Acquire) == 0 {
            return;
        }
        if tokio::time::timeout_at(deadline, arrived).await.is_err() {
            return;
        }
    }
}

fn answer_each(batch: Vec<Pending>, decided: Vec<CommitDone>) {
    for (pending, done) in batch.into_iter().zip(decided) {
        let _ = pending.reply.send(Ok(done));
    }
}

fn answer_all(batch: Vec<Pending>, answer: impl Fn(&Pending) -> Result<CommitDone, String>) {
    for pending in batch {
        let done = answer(&pending);
        let _ = pending.reply.send(done);
    }
}
