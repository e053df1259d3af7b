//! A closed-loop load generator: N workers each run one operation after another for a fixed
//! time; throughput is completed operations per second, latency from a histogram.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

pub struct Outcome {
    pub ops_per_sec: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    /// Operations completed.
    pub done: u64,
    pub errors: u64,
}

/// Runs `op(worker, i)` in `workers` concurrent loops for `run`.
pub async fn closed_loop<F, Fut>(workers: usize, run: Duration, op: F) -> Outcome
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let mut handles = Vec::new();
    for worker in 0..workers {
        let op = op.clone();
        handles.push(tokio::spawn(async move {
            let mut histogram = Histogram::<u64>::new(3).expect("histogram");
            let (mut done, mut errors) = (0u64, 0u64);
            while started.elapsed() < run {
                let t = Instant::now();
                if op(worker, done + errors).await {
                    done += 1;
                    let _ = histogram.record(t.elapsed().as_micros() as u64);
                } else {
                    errors += 1;
                }
            }
            (histogram, done, errors)
        }));
    }
    let mut all = Histogram::<u64>::new(3).expect("histogram");
    let (mut done, mut errors) = (0, 0);
    for handle in handles {
        let (h, d, e) = handle.await.expect("worker");
        all.add(h).expect("same histogram shape");
        done += d;
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Outcome {
        ops_per_sec: done as f64 / elapsed,
        p50_us: all.value_at_quantile(0.5),
        p99_us: all.value_at_quantile(0.99),
        done,
        errors,
    }
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// The `q` quantile of values already sorted (as [`median`] leaves them).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len() - 1);
    sorted[i]
}

/// Per-worker counts merged into one [`Outcome`]; for loops that keep a connection per worker.
pub struct Tally {
    histogram: Histogram<u64>,
    pub done: u64,
    pub errors: u64,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            histogram: Histogram::new(3).expect("histogram"),
            done: 0,
            errors: 0,
        }
    }
}

impl Tally {
    /// `ops` operations completed in one round trip that took `took`.
    pub fn record(&mut self, ops: u64, took: Duration) {
        self.done += ops;
        let _ = self.histogram.record(took.as_micros() as u64);
    }

    pub fn merge(&mut self, other: Tally) {
        self.histogram.add(other.histogram).expect("same shape");
        self.done += other.done;
        self.errors += other.errors;
    }

    pub fn outcome(&self, elapsed: Duration) -> Outcome {
        Outcome {
            ops_per_sec: self.done as f64 / elapsed.as_secs_f64(),
            p50_us: self.histogram.value_at_quantile(0.5),
            p99_us: self.histogram.value_at_quantile(0.99),
            done: self.done,
            errors: self.errors,
        }
    }
}
