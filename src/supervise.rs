//! Supervised tasks: every task a run spawns is named, joined, and watched, so one that
//! panics or fails is reported at ERROR and stops its run instead of vanishing with the work
//! it held.
//!
//! A `Supervisor` owns a [`JoinSet`] of tasks. Each task runs inside a wrapper that turns a
//! panic into a [`TaskFailure`], records it, logs it once, and cancels the supervisor's
//! `on_failure` token — the token the rest of the run listens to (ingest's halt, serve's
//! stop). Tasks return `()` or `Result<(), E: Display>` (`TaskOutput`), so loops that report
//! permanent errors as `Err` and loops that only ever return on cancellation are supervised
//! alike. Long-running service loops are spawned with `Supervisor::spawn_until`: ending
//! while their token is not cancelled counts as a failure too.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How a supervised task failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TaskFailure {
    /// The task panicked; `message` is the panic payload when it was a string.
    #[error("{task} panicked: {message}")]
    Panicked {
        /// The task's name.
        task: String,
        /// The panic payload, or a placeholder when it was not a string.
        message: String,
    },
    /// The task returned an error (a permanent one: transient errors are retried inside).
    #[error("{task} failed: {message}")]
    Failed {
        /// The task's name.
        task: String,
        /// The error, displayed.
        message: String,
    },
    /// A service loop returned although nobody asked it to stop.
    #[error("{task} stopped unexpectedly")]
    Ended {
        /// The task's name.
        task: String,
    },
    /// The task was aborted from outside the supervisor.
    #[error("{task} was aborted")]
    Aborted {
        /// The task's name.
        task: String,
    },
}

impl TaskFailure {
    /// The name the task was spawned with.
    pub fn task(&self) -> &str {
        match self {
            TaskFailure::Panicked { task, .. }
            | TaskFailure::Failed { task, .. }
            | TaskFailure::Ended { task }
            | TaskFailure::Aborted { task } => task,
        }
    }
}

/// What a supervised task may return: nothing, or a result whose error is shown.
pub(crate) trait TaskOutput {
    /// `Err` with the error's text when the task failed.
    fn into_task_result(self) -> Result<(), String>;
}

impl TaskOutput for () {
    fn into_task_result(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: std::fmt::Display> TaskOutput for Result<(), E> {
    fn into_task_result(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Runs `fut` to completion, turning a panic into [`TaskFailure::Panicked`] and an `Err`
/// output into [`TaskFailure::Failed`].
pub(crate) async fn catch<F>(task: &str, fut: F) -> Result<(), TaskFailure>
where
    F: Future,
    F::Output: TaskOutput,
{
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(out) => {
            out.into_task_result().map_err(|message| TaskFailure::Failed { task: task.to_string(), message })
        }
        Err(payload) => {
            Err(TaskFailure::Panicked { task: task.to_string(), message: panic_message(payload.as_ref()) })
        }
    }
}

/// A set of named tasks, each joined and watched (see the module doc).
pub(crate) struct Supervisor {
    set: JoinSet<Result<(), TaskFailure>>,
    names: HashMap<tokio::task::Id, String>,
    on_failure: CancellationToken,
    failures: Arc<Mutex<Vec<TaskFailure>>>,
}

impl Supervisor {
    /// A supervisor that cancels `on_failure` as soon as any of its tasks fails.
    pub fn new(on_failure: CancellationToken) -> Self {
        Supervisor { set: JoinSet::new(), names: HashMap::new(), on_failure, failures: Arc::default() }
    }

    /// Spawns a task that may finish on its own (`Ok` or `()` is success).
    pub fn spawn<F>(&mut self, name: impl Into<String>, fut: F)
    where
        F: Future + Send + 'static,
        F::Output: TaskOutput,
    {
        self.spawn_inner(name.into(), fut, None);
    }

    /// [`Supervisor::spawn`] for a task that feeds another through a channel: it runs on a
    /// blocking-pool thread of its own (driven by `Handle::block_on`), beside the task it
    /// feeds. On the runtime's workers, tokio runs a task woken by another next on the same
    /// worker, so a producer and its consumer took turns on one core instead of using two.
    /// Its panic is the task's, as with `spawn`.
    pub fn spawn_on_own_thread<F>(&mut self, name: impl Into<String>, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::current();
        self.spawn(name, async move {
            match tokio::task::spawn_blocking(move || runtime.block_on(fut)).await {
                Ok(()) => {}
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // The runtime is shutting down: nothing is left to feed.
                Err(_) => {}
            }
        });
    }

    /// Spawns a service loop that must run until `until` is cancelled: returning earlier,
    /// even with `Ok`, is a failure.
    pub(crate) fn spawn_until<F>(&mut self, name: impl Into<String>, until: CancellationToken, fut: F)
    where
        F: Future + Send + 'static,
        F::Output: TaskOutput,
    {
        self.spawn_inner(name.into(), fut, Some(until));
    }

    fn spawn_inner<F>(&mut self, name: String, fut: F, until: Option<CancellationToken>)
    where
        F: Future + Send + 'static,
        F::Output: TaskOutput,
    {
        let on_failure = self.on_failure.clone();
        let failures = self.failures.clone();
        let task = name.clone();
        let handle = self.set.spawn(async move {
            let mut result = catch(&name, fut).await;
            if result.is_ok()
                && let Some(until) = until
                && !until.is_cancelled()
            {
                result = Err(TaskFailure::Ended { task: name });
            }
            if let Err(f) = &result {
                record(&failures, &on_failure, f.clone());
            }
            result
        });
        self.names.insert(handle.id(), task);
    }

    /// Every failure so far, in the order they happened.
    pub fn failures(&self) -> Vec<TaskFailure> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Tasks not yet joined.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when every task has been joined.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Waits until every task has ended. Cancel-safe: after a timeout, call it again (or
    /// [`Supervisor::abort_all`]) and nothing is lost.
    pub async fn wait(&mut self) {
        while let Some(joined) = self.set.join_next_with_id().await {
            match joined {
                Ok((id, _)) => {
                    self.names.remove(&id);
                }
                Err(e) => {
                    // The wrapper catches panics, so only an abort from outside ends a task
                    // this way.
                    let task = self.names.remove(&e.id()).unwrap_or_else(|| format!("task {}", e.id()));
                    record(&self.failures, &self.on_failure, TaskFailure::Aborted { task });
                }
            }
        }
    }

    /// Aborts every task still running (a stop whose deadline has passed) and waits for
    /// them. Returns their names; they are logged, not counted as failures: they were told to
    /// stop and only took too long.
    pub(crate) async fn abort_all(&mut self) -> Vec<String> {
        self.set.abort_all();
        let mut aborted = Vec::new();
        while let Some(joined) = self.set.join_next_with_id().await {
            let id = match &joined {
                Ok((id, _)) => *id,
                Err(e) => e.id(),
            };
            let name = self.names.remove(&id).unwrap_or_else(|| format!("task {id}"));
            if joined.is_err() {
                tracing::warn!(task = %name, "aborted: did not stop within its deadline");
                aborted.push(name);
            }
        }
        aborted
    }
}

fn record(failures: &Mutex<Vec<TaskFailure>>, on_failure: &CancellationToken, f: TaskFailure) {
    tracing::error!(task = %f.task(), error = %f, "task failed; stopping");
    failures.lock().unwrap_or_else(PoisonError::into_inner).push(f);
    on_failure.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that panics with "boom 7" (not a constant panic: the compiler cannot see it).
    fn boom() -> impl Future<Output = ()> + Send + 'static {
        let n = std::hint::black_box(7);
        async move {
            if n == 7 {
                panic!("boom {n}");
            }
        }
    }

    /// Waits for `s` and checks that its one failure is `task`'s "boom 7" and the run stopped.
    async fn assert_one_boom(mut s: Supervisor, stop: &CancellationToken, task: &str) {
        s.wait().await;
        assert!(stop.is_cancelled());
        assert_eq!(s.failures(), vec![TaskFailure::Panicked { task: task.into(), message: "boom 7".into() }]);
    }

    #[tokio::test]
    async fn a_panicking_task_is_reported_by_name_and_cancels_the_run() {
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(stop.clone());
        s.spawn("fine", async {});
        s.spawn("worker 3", boom());
        assert_one_boom(s, &stop, "worker 3").await;
    }

    /// On the test's one-thread runtime: the task runs on another thread, its timers and
    /// channels still work (the runtime's driver serves them), and its panic is reported.
    #[tokio::test]
    async fn a_task_on_its_own_thread_runs_beside_the_runtime_and_its_panic_is_reported() {
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(stop.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        s.spawn_on_own_thread("reader", async move {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            tx.send(std::thread::current().id()).unwrap();
        });
        assert_ne!(rx.await.unwrap(), std::thread::current().id());
        s.spawn_on_own_thread("reader 2", boom());
        assert_one_boom(s, &stop, "reader 2").await;
    }

    #[tokio::test]
    async fn errors_and_early_ends_of_service_loops_are_failures() {
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(stop.clone());
        s.spawn("relay", async { Err::<(), _>("permanent: table gone") });
        s.wait().await;
        assert_eq!(s.failures()[0].to_string(), "relay failed: permanent: table gone");

        let until = CancellationToken::new();
        let mut s = Supervisor::new(until.clone());
        s.spawn_until("scheduler", until.clone(), async {});
        s.wait().await;
        assert_eq!(s.failures(), vec![TaskFailure::Ended { task: "scheduler".into() }]);

        // Ending after the stop was asked for is the normal way out.
        let until = CancellationToken::new();
        let mut s = Supervisor::new(until.clone());
        let t = until.clone();
        s.spawn_until("replayer", until.clone(), async move { t.cancelled().await });
        until.cancel();
        s.wait().await;
        assert!(s.failures().is_empty());
    }

    #[tokio::test]
    async fn tasks_past_their_deadline_are_aborted_by_name() {
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(stop.clone());
        s.spawn("stuck", std::future::pending::<()>());
        s.spawn("done", async {});
        tokio::task::yield_now().await;
        assert_eq!(s.abort_all().await, vec!["stuck".to_string()]);
        assert!(s.is_empty());
        assert!(s.failures().is_empty() && !stop.is_cancelled());
    }
}
