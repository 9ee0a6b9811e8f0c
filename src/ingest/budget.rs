//! The in-flight byte budget of one ingest run.
//!
//! Channel capacities bound the number of records in flight, not their size: twenty lines
//! of 8 MB metadata fit in any count bound and cost gigabytes. So every record is charged
//! its size (its line plus its parsed form, see [`super::reader::Record::approx_bytes`])
//! when the reader hands it over, and the [`Charge`] travels with it — through the batcher's
//! window, a worker's job and a writer's buffer — until its outcome is written, or it is
//! skipped or dropped. The reader waits while the budget is spent, so memory in flight stays
//! near the budget whatever the corpus holds.
//!
//! A record larger than the whole budget is charged the whole budget: it runs alone rather
//! than never.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of input a run holds in flight.
#[derive(Debug, Clone)]
pub(crate) struct ByteBudget {
    permits: Arc<Semaphore>,
    capacity: u32,
}

impl ByteBudget {
    /// Default budget: 64 MiB, several thousand typical chunks (far more than the pipeline's
    /// count bounds hold), or a handful of multi-megabyte records.
    pub(crate) const DEFAULT: u64 = 64 * 1024 * 1024;
    /// Smallest budget: 1 MiB (smaller values are raised to it).
    pub(crate) const MIN: u64 = 1024 * 1024;
    /// Largest budget: 4 GiB - 1 (larger values are lowered to it).
    pub const MAX: u64 = u32::MAX as u64;

    /// A budget of `bytes`, clamped to `MIN..=MAX`.
    pub fn new(bytes: u64) -> Self {
        let capacity = bytes.clamp(Self::MIN, Self::MAX) as u32;
        ByteBudget { permits: Arc::new(Semaphore::new(capacity as usize)), capacity }
    }

    /// The budget in bytes, after clamping.
    pub(crate) fn capacity(&self) -> u64 {
        u64::from(self.capacity)
    }

    /// Bytes not charged to any record right now (what one stream read may bring in, see
    /// `ingest/source/read.rs`).
    pub(crate) fn available(&self) -> u64 {
        self.permits.available_permits() as u64
    }

    /// Waits until `bytes` (at least 1, at most the whole budget) are free and charges them.
    /// Cancel-safe: dropping the future charges nothing.
    pub(crate) async fn charge(&self, bytes: u64) -> Charge {
        let n = bytes.clamp(1, u64::from(self.capacity)) as u32;
        match self.permits.clone().acquire_many_owned(n).await {
            Ok(permit) => Charge(Some(permit)),
            // The semaphore is never closed.
            Err(_) => Charge(None),
        }
    }
}

impl ByteBudget {
    /// Charges `bytes` (at least 1, at most the whole budget) if they are free right now.
    pub(crate) fn try_charge(&self, bytes: u64) -> Option<Charge> {
        let n = bytes.clamp(1, u64::from(self.capacity)) as u32;
        self.permits.clone().try_acquire_many_owned(n).ok().map(|permit| Charge(Some(permit)))
    }
}

/// Bytes charged to one or more records; released when dropped.
#[derive(Debug, Default)]
pub(crate) struct Charge(Option<OwnedSemaphorePermit>);

impl Charge {
    /// Takes over `other`'s bytes: both are released together.
    pub(crate) fn merge(&mut self, other: Charge) {
        match (&mut self.0, other.0) {
            (Some(mine), Some(theirs)) => mine.merge(theirs),
            (None, theirs) => self.0 = theirs,
            (Some(_), None) => {}
        }
    }

    /// Takes `bytes` of this charge (at most all of it) into a charge of their own.
    pub(crate) fn split(&mut self, bytes: u64) -> Charge {
        let n = bytes.min(self.bytes()) as usize;
        match (&mut self.0, n) {
            (Some(mine), 1..) => Charge(mine.split(n)),
            _ => Charge(None),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.0.as_ref().map_or(0, |p| p.num_permits() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn charges_wait_for_released_bytes_and_oversized_records_run_alone() {
        let budget = ByteBudget::new(ByteBudget::MIN);
        let mut a = budget.charge(600 * 1024).await;
        let b = budget.charge(400 * 1024).await;
        a.merge(b);
        assert_eq!(a.bytes(), 1000 * 1024);
        // 100 KiB more does not fit until `a` is released.
        let more = budget.charge(100 * 1024);
        tokio::pin!(more);
        assert!(futures::poll!(more.as_mut()).is_pending());
        drop(a);
        assert_eq!(more.await.bytes(), 100 * 1024);
        assert_eq!(budget.available(), ByteBudget::MIN);
        // Larger than the budget: charged the whole budget, so it runs alone.
        let huge = budget.charge(u64::MAX).await;
        assert_eq!(huge.bytes(), ByteBudget::MIN);
        assert_eq!(budget.available(), 0);
    }

    #[tokio::test]
    async fn a_charge_taken_without_waiting_splits_into_parts_released_apart() {
        let budget = ByteBudget::new(ByteBudget::MIN);
        let mut block = budget.try_charge(ByteBudget::MIN).expect("all of it is free");
        assert!(budget.try_charge(1).is_none(), "nothing is left");
        let part = block.split(1024);
        assert_eq!((part.bytes(), block.bytes()), (1024, ByteBudget::MIN - 1024));
        assert_eq!(block.split(0).bytes(), 0);
        drop(part);
        assert_eq!(budget.available(), 1024);
        assert_eq!(block.split(u64::MAX).bytes(), ByteBudget::MIN - 1024, "at most all of it");
        assert_eq!(block.bytes(), 0);
        assert_eq!(budget.available(), ByteBudget::MIN);
    }

    #[test]
    fn settings_are_clamped() {
        assert_eq!(ByteBudget::new(0).capacity(), ByteBudget::MIN);
        assert_eq!(ByteBudget::new(u64::MAX).capacity(), ByteBudget::MAX);
        assert_eq!(ByteBudget::new(ByteBudget::DEFAULT).capacity(), ByteBudget::DEFAULT);
    }
}
