//! The nemesis: every 1-3 s (seeded) it picks a fault and applies it, and heals it later.
//!
//! - `pause-worker`: SIGSTOP a worker whose job is running (runner and job) for longer than the
//!   lease TTL, then SIGCONT the job and, a moment later, the runner: the job wakes up stale
//!   and writes before its runner can stop it (the paused holder of the design notes).
//! - `kill-worker`: SIGKILL a worker's runner and job.
//! - `kill-leader` / `kill-follower`: SIGKILL a node (its gateways die mid-write), restart it
//!   1-3 s later.
//! - `restart-store`: crash and restart Redis (SIGKILL) or PostgreSQL (`-m immediate`) at once;
//!   what they acknowledged must survive, and so must their fences.
//! - `partition`: cut a node's Raft links to and from both others (the testkit's fault proxies)
//!   for 2-5 s; its clients and gateways still reach it, as in a real partition's minority.
//! - `delay`: hold every chunk on a node's Raft links 50-300 ms, each way, for 3-6 s.
//! - `drop`: on a node's Raft links, every 3rd-10th chunk of a connection is dropped and the
//!   connection cut, for 3-6 s.
//!
//! At most one node is down (killed or partitioned), one worker paused and one node's links
//! faulty at a time, so a majority and a writer are always possible.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::Rng;
use serde::Serialize;
use tokio::time::Instant;

use fencegate_testkit::fault_proxy::LinkFault;

use crate::history::monotonic_ns;
use crate::workload::{Workload, TTL};
use crate::world::World;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum FaultKind {
    PauseWorker,
    KillWorker,
    KillLeader,
    KillFollower,
    RestartStore,
    Partition,
    Delay,
    Drop,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::PauseWorker,
        FaultKind::KillWorker,
        FaultKind::KillLeader,
        FaultKind::KillFollower,
        FaultKind::RestartStore,
        FaultKind::Partition,
        FaultKind::Delay,
        FaultKind::Drop,
    ];
}

impl std::str::FromStr for FaultKind {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.to_string() == text)
            .ok_or_else(|| {
                let names: Vec<String> = Self::ALL.iter().map(|k| k.to_string()).collect();
                format!("unknown fault {text:?}; one of {}", names.join(", "))
            })
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultKind::PauseWorker => "pause-worker",
            FaultKind::KillWorker => "kill-worker",
            FaultKind::KillLeader => "kill-leader",
            FaultKind::KillFollower => "kill-follower",
            FaultKind::RestartStore => "restart-store",
            FaultKind::Partition => "partition",
            FaultKind::Delay => "delay",
            FaultKind::Drop => "drop",
        })
    }
}

/// One fault as applied: when (CLOCK_MONOTONIC ns), to whom.
#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    pub t: u64,
    pub kind: FaultKind,
    pub target: String,
}

/// What is to be undone, and when.
enum Heal {
    ResumeJob {
        job: u32,
    },
    ResumeRunner {
        runner: u32,
    },
    RestartNode {
        id: u64,
    },
    /// Every link passes again; `partitioned` when the fault cut a node off.
    Links {
        partitioned: bool,
    },
}

pub struct Nemesis {
    rng: StdRng,
    kinds: Vec<FaultKind>,
    pub faults: Vec<Fault>,
    heals: Vec<(Instant, Heal)>,
    down: Option<u64>,
    paused: bool,
    /// A node's links are faulty (one node's at a time).
    links_faulty: bool,
}

impl Nemesis {
    /// A nemesis choosing among `kinds` (all when empty).
    pub fn new(rng: StdRng, kinds: &[FaultKind]) -> Self {
        Self {
            rng,
            kinds: if kinds.is_empty() {
                FaultKind::ALL.to_vec()
            } else {
                kinds.to_vec()
            },
            faults: Vec::new(),
            heals: Vec::new(),
            down: None,
            paused: false,
            links_faulty: false,
        }
    }

    /// Injects faults until `until`, then heals everything still broken.
    pub async fn run(&mut self, world: &mut World, workload: &Workload, until: Instant) {
        let mut next = Instant::now() + self.gap();
        // Bounded by `until`; each turn sleeps at least 50 ms.
        while Instant::now() < until {
            self.heal_due(world, false).await;
            if Instant::now() >= next {
                self.inject(world, workload).await;
                next = Instant::now() + self.gap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.heal_due(world, true).await;
    }

    fn gap(&mut self) -> Duration {
        Duration::from_millis(self.rng.gen_range(1_000..=3_000))
    }

    async fn inject(&mut self, world: &mut World, workload: &Workload) {
        let t = monotonic_ns();
        let kind = self.kinds[self.rng.gen_range(0..self.kinds.len())];
        // A pause only tests something when it stops a job that holds the lock.
        let candidates: Vec<u32> = workload
            .ids()
            .into_iter()
            .filter(|id| kind != FaultKind::PauseWorker || workload.job(*id).is_some())
            .collect();
        if candidates.is_empty() {
            return;
        }
        let worker = candidates[self.rng.gen_range(0..candidates.len())];
        let target = match kind {
            FaultKind::PauseWorker => {
                if self.paused {
                    return;
                }
                let (Some(runner), Some(job)) = (workload.runner(worker), workload.job(worker))
                else {
                    return;
                };
                stop_group(runner, Signal::SIGSTOP);
                stop_group(job, Signal::SIGSTOP);
                self.paused = true;
                let wake = Instant::now() + TTL + Duration::from_millis(2_000);
                self.heals.push((wake, Heal::ResumeJob { job }));
                self.heals.push((
                    wake + Duration::from_millis(300),
                    Heal::ResumeRunner { runner },
                ));
                format!("worker {worker}")
            }
            FaultKind::KillWorker => {
                let Some(runner) = workload.runner(worker) else {
                    return;
                };
                if let Some(job) = workload.job(worker) {
                    stop_group(job, Signal::SIGKILL);
                }
                stop_group(runner, Signal::SIGKILL);
                format!("worker {worker}")
            }
            FaultKind::RestartStore => {
                let mut stores = Vec::new();
                if world.redis.is_some() {
                    stores.push("redis");
                }
                if world.pg.is_some() {
                    stores.push("postgres");
                }
                if stores.is_empty() {
                    return;
                }
                let store = stores[self.rng.gen_range(0..stores.len())];
                // Blocking for the second or two a restart takes; the workers run on other
                // threads.
                tokio::task::block_in_place(|| match store {
                    "redis" => world.redis.as_mut().expect("redis runs").restart(),
                    _ => world.pg.as_ref().expect("postgres runs").restart(),
                });
                store.to_owned()
            }
            FaultKind::KillLeader | FaultKind::KillFollower => {
                if self.down.is_some() {
                    return;
                }
                let live = world.cluster.ids();
                let Some(leader) = world.leader(&live, Duration::from_secs(2)).await else {
                    return;
                };
                let id = if kind == FaultKind::KillLeader {
                    leader
                } else {
                    let followers: Vec<u64> = live.into_iter().filter(|i| *i != leader).collect();
                    followers[self.rng.gen_range(0..followers.len())]
                };
                world.cluster.kill(id);
                self.down = Some(id);
                let back =
                    Instant::now() + Duration::from_millis(self.rng.gen_range(1_000..=3_000));
                self.heals.push((back, Heal::RestartNode { id }));
                format!("node {id}")
            }
            FaultKind::Partition | FaultKind::Delay | FaultKind::Drop => {
                let partition = kind == FaultKind::Partition;
                if self.links_faulty || (partition && self.down.is_some()) {
                    return;
                }
                // Any live node: a partitioned leader is the deposed-leader story, a follower
                // the lagging one.
                let live: Vec<u64> = world
                    .cluster
                    .ids()
                    .into_iter()
                    .filter(|id| Some(*id) != self.down)
                    .collect();
                let id = live[self.rng.gen_range(0..live.len())];
                let (fault, lasts, what) = match kind {
                    FaultKind::Partition => (
                        LinkFault::Partition,
                        self.rng.gen_range(2_000..=5_000),
                        String::new(),
                    ),
                    FaultKind::Delay => {
                        let ms = self.rng.gen_range(50..=300);
                        let fault = LinkFault::Delay(Duration::from_millis(ms));
                        (
                            fault,
                            self.rng.gen_range(3_000..=6_000),
                            format!(", {ms} ms"),
                        )
                    }
                    _ => {
                        let every = self.rng.gen_range(3..=10);
                        let fault = LinkFault::Drop { every };
                        let what = format!(", 1 chunk in {every} dropped");
                        (fault, self.rng.gen_range(3_000..=6_000), what)
                    }
                };
                world.cluster.set_links_of(id, fault);
                self.links_faulty = true;
                if partition {
                    self.down = Some(id);
                }
                let heal = Instant::now() + Duration::from_millis(lasts);
                self.heals.push((
                    heal,
                    Heal::Links {
                        partitioned: partition,
                    },
                ));
                format!("node {id}{what}")
            }
        };
        self.faults.push(Fault { t, kind, target });
    }

    /// Undoes what is due (everything, when `all`), in order.
    async fn heal_due(&mut self, world: &mut World, all: bool) {
        self.heals.sort_by_key(|(when, _)| *when);
        while let Some((when, _)) = self.heals.first() {
            if !all && *when > Instant::now() {
                break;
            }
            let (when, heal) = self.heals.remove(0);
            tokio::time::sleep_until(when).await;
            match heal {
                Heal::ResumeJob { job } => stop_group(job, Signal::SIGCONT),
                Heal::ResumeRunner { runner } => {
                    stop_group(runner, Signal::SIGCONT);
                    self.paused = false;
                }
                Heal::RestartNode { id } => {
                    world.cluster.spawn(id);
                    self.down = None;
                }
                Heal::Links { partitioned } => {
                    world.cluster.heal_links();
                    self.links_faulty = false;
                    if partitioned {
                        self.down = None;
                    }
                }
            }
        }
    }

    /// How many faults of each kind were injected.
    pub fn counts(&self) -> BTreeMap<FaultKind, usize> {
        let mut counts = BTreeMap::new();
        for fault in &self.faults {
            *counts.entry(fault.kind).or_insert(0) += 1;
        }
        counts
    }
}

/// Sends `signal` to the process group led by `pid` (runners and jobs each lead their own).
fn stop_group(pid: u32, signal: Signal) {
    let _ = killpg(Pid::from_raw(pid as i32), signal);
}
