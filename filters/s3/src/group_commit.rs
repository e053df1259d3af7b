//! Manifest mode, group commit: concurrent commits into one manifest from this node share one
//! conditional PUT. Each commit queues its change, then waits for the resource's leader lock;
//! whoever holds it takes every queued change, plans them in order over the manifest read
//! ([`crate::manifest::plan_commit`]: a stale token is refused, the others raise the fence and
//! apply), and writes the result once with `If-Match`. Answers are given only after that write
//! succeeds, so a refusal always rests on a fence the store holds. One node therefore sends at
//! most one manifest write per resource at a time; other nodes still race through `If-Match`.

use std::sync::{Arc, Mutex};

use fencegate_core::{Rejection, Token};
use tokio::sync::oneshot;

use crate::error::S3Error;
use crate::gateway::Shared;
use crate::manifest::{plan_commit, Change, CommitPlan, Manifest};
use crate::rewrite::ClientConditions;

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

/// The queue and leader lock of one manifest.
#[derive(Default)]
pub(crate) struct Committer {
    queue: Mutex<Vec<Pending>>,
    leader: tokio::sync::Mutex<()>,
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

    /// Commits `change` into the manifest of `resource`, together with whatever else is
    /// queued for it.
    pub(crate) async fn commit_grouped(
        &self,
        bucket: &str,
        resource: &str,
        token: &Token,
        target: String,
        change: Change,
        conditions: ClientConditions,
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
        let leader = committer.leader.lock().await;
        // An earlier leader may have committed this change already.
        if let Ok(done) = answer.try_recv() {
            return done.map_err(S3Error::Upstream);
        }
        let batch = std::mem::take(&mut *committer.queue.lock().expect("poisoned"));
        self.commit_batch(bucket, resource, batch).await;
        drop(leader);
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
            let mut working: Option<Manifest> = current.as_ref().map(|l| (*l.manifest).clone());
            let mut decided = Vec::with_capacity(batch.len());
            let mut changed = false;
            let mut recheck = false;
            for pending in &batch {
                let plan = plan_commit(
                    working.as_ref(),
                    &pending.token,
                    &pending.target,
                    &pending.change,
                    &pending.conditions,
                );
                decided.push(match plan {
                    CommitPlan::Refuse(rejection) => CommitDone::Refused(rejection),
                    // A client precondition judged on a cached copy is checked on a fresh one.
                    CommitPlan::PreconditionFailed | CommitPlan::NoSuchKey if !revalidate => {
                        recheck = true;
                        break;
                    }
                    CommitPlan::PreconditionFailed => CommitDone::PreconditionFailed,
                    CommitPlan::NoSuchKey => CommitDone::NoSuchKey,
                    CommitPlan::Commit(next) => {
                        working = Some(next);
                        changed = true;
                        CommitDone::Committed
                    }
                });
            }
            if recheck {
                revalidate = true;
                continue;
            }
            if !changed {
                return answer_each(batch, decided);
            }
            let next = working.expect("a change was planned");
            match self
                .commit_manifest(bucket, resource, current.as_ref(), next)
                .await
            {
                Ok(Some(_)) => {
                    for done in &decided {
                        if matches!(done, CommitDone::Committed) {
                            self.audit.applied("s3");
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
