//! Waiting acquires, served one at a time in arrival order.
//!
//! Each resource has a fair (FIFO) turn lock. Only the waiter holding the turn listens for the
//! lock to be freed, so a release wakes exactly one waiter rather than a herd, and a later
//! arrival cannot overtake an earlier one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

#[derive(Default)]
pub struct Slot {
    /// tokio's mutex queues lockers in FIFO order.
    pub turn: tokio::sync::Mutex<()>,
    pub freed: Notify,
}

#[derive(Default)]
pub struct Waiters {
    slots: Mutex<HashMap<String, Arc<Slot>>>,
}

/// Slots are dropped once nobody waits; this bounds how often we sweep for them.
const SWEEP_ABOVE: usize = 1024;

impl Waiters {
    pub fn slot(&self, resource: &str) -> Arc<Slot> {
        let mut slots = self.slots.lock().expect("waiters lock poisoned");
        if slots.len() > SWEEP_ABOVE {
            slots.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
        slots.entry(resource.to_owned()).or_default().clone()
    }

    /// Called when a lock is deleted: lets the waiter holding the turn try again.
    pub fn freed(&self, resource: &str) {
        let slot = self
            .slots
            .lock()
            .expect("waiters lock poisoned")
            .get(resource)
            .cloned();
        if let Some(slot) = slot {
            // notify_one keeps a permit if the turn holder is between attempts, so no wake-up
            // is lost.
            slot.freed.notify_one();
        }
    }
}
