//! The workers: each slot is a loop of `fencegate lock run job -- fencegate-chaos worker ...`,
//! restarted whenever it ends (lock lost, killed, refused) until the run is over.
//!
//! Each runner is its own process group (so the nemesis can stop or kill it whole); the job
//! `lock run` starts is another group, found through the pid file the worker writes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tokio::process::Command;

/// How the workers hold their lock: a short lease, so a paused holder loses it quickly.
pub const TTL: Duration = Duration::from_secs(3);
pub const MARGIN: Duration = Duration::from_secs(1);
/// How long a runner waits for the lock before it starts over.
const WAIT: Duration = Duration::from_secs(20);

/// What the nemesis and the end of the run need to know about one slot.
#[derive(Default)]
struct SlotState {
    runner: Option<u32>,
    runs: u32,
}

pub struct Workload {
    dir: PathBuf,
    slots: Vec<Arc<Mutex<SlotState>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Everything a runner needs to start its job.
pub struct WorkerSpec {
    pub fencegate: PathBuf,
    pub me: PathBuf,
    pub endpoints: String,
    /// The worker's target options (`--redis 1=127.0.0.1:port`, ...).
    pub targets: Vec<String>,
    /// The longest a worker may live (bounds a job whose runner was killed).
    pub max_time: Duration,
}

impl Workload {
    pub fn start(dir: &Path, workers: u32, spec: WorkerSpec) -> Self {
        let spec = Arc::new(spec);
        let stop = Arc::new(AtomicBool::new(false));
        let mut slots = Vec::new();
        let mut tasks = Vec::new();
        for id in 1..=workers {
            let slot = Arc::new(Mutex::new(SlotState::default()));
            slots.push(slot.clone());
            let (spec, stop, dir) = (spec.clone(), stop.clone(), dir.to_owned());
            tasks.push(tokio::spawn(async move {
                // Bounded by the stop flag, which the run sets at its end.
                while !stop.load(Ordering::Relaxed) {
                    let mut command = runner_command(&spec, &dir, id);
                    let Ok(mut child) = command.spawn() else {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    };
                    {
                        let mut state = slot.lock().unwrap();
                        state.runner = child.id();
                        state.runs += 1;
                    }
                    let _ = child.wait().await;
                    slot.lock().unwrap().runner = None;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
        }
        Self {
            dir: dir.to_owned(),
            slots,
            stop,
            tasks,
        }
    }

    /// Worker slot numbers, from 1.
    pub fn ids(&self) -> Vec<u32> {
        (1..=self.slots.len() as u32).collect()
    }

    /// The runner of slot `id`, while one runs.
    pub fn runner(&self, id: u32) -> Option<u32> {
        self.slots[id as usize - 1].lock().unwrap().runner
    }

    /// The job of slot `id` while it runs under its current runner: the pid file's process,
    /// if its parent is that runner (a stale pid file names a process that is gone or another).
    pub fn job(&self, id: u32) -> Option<u32> {
        let runner = self.runner(id)?;
        let pid: u32 = std::fs::read_to_string(pid_file(&self.dir, id))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        (parent_of(pid)? == runner).then_some(pid)
    }

    /// How many runners each slot has started.
    pub fn runs(&self) -> u32 {
        self.slots.iter().map(|s| s.lock().unwrap().runs).sum()
    }

    /// Ends the run: no new runners; every runner gets SIGTERM (it passes it to its job), and
    /// what is still alive after `grace` gets SIGKILL, runner and job groups both.
    pub async fn stop(self, grace: Duration) {
        self.stop.store(true, Ordering::Relaxed);
        let ids = self.ids();
        let jobs: Vec<Option<u32>> = ids.iter().map(|id| self.job(*id)).collect();
        for id in &ids {
            if let Some(runner) = self.runner(*id) {
                let _ = killpg(Pid::from_raw(runner as i32), Signal::SIGCONT);
                let _ = kill(Pid::from_raw(runner as i32), Signal::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        for task in self.tasks {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let _ = tokio::time::timeout(left, task).await;
        }
        for (i, id) in ids.iter().enumerate() {
            if let Some(runner) = self.slots[*id as usize - 1].lock().unwrap().runner {
                let _ = killpg(Pid::from_raw(runner as i32), Signal::SIGKILL);
            }
            if let Some(job) = jobs[i] {
                let _ = killpg(Pid::from_raw(job as i32), Signal::SIGKILL);
            }
        }
    }
}

/// `lock run` around one worker process of slot `id`.
fn runner_command(spec: &WorkerSpec, dir: &Path, id: u32) -> Command {
    let secs = |d: Duration| format!("{}ms", d.as_millis());
    let mut command = Command::new(&spec.fencegate);
    command
        .args(["lock", "run", crate::world::RESOURCE])
        .args(["--ttl", &secs(TTL), "--margin", &secs(MARGIN)])
        .args(["--wait", &secs(WAIT), "--grace", "1s"])
        .args(["--holder", &format!("worker-{id}")])
        .arg("--stop-file")
        .arg(crate::stop_times::next_path(dir, id))
        .args(["--endpoint", &spec.endpoints, "--"])
        .arg(&spec.me)
        .args(["worker", "--id", &id.to_string()])
        .arg("--history")
        .arg(dir.join(format!("w{id}.jsonl")))
        .arg("--pid-file")
        .arg(pid_file(dir, id))
        .args(["--max-time", &secs(spec.max_time)]);
    command.args(&spec.targets);
    command
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(runner_log(dir, id))
        .kill_on_drop(true);
    command
}

fn runner_log(dir: &Path, id: u32) -> std::process::Stdio {
    std::fs::File::options()
        .create(true)
        .append(true)
        .open(dir.join(format!("w{id}.log")))
        .map(Into::into)
        .unwrap_or_else(|_| std::process::Stdio::null())
}

fn pid_file(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("w{id}.pid"))
}

/// The parent process id of `pid` (field 4 of /proc/PID/stat, after the command's parentheses).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}
