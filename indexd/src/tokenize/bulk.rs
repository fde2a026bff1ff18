//! Large bodies' local tokenization, on threads of its own at a lower CPU
//! priority.
//!
//! A body over `admission.small_body_bytes` is rarely an agent's next turn:
//! more often a pasted file, a batch job's prompt, or a client probing what
//! indexd costs. Its work runs here, on as many threads as the admission
//! budget lets such bodies be in flight (`max_concurrent -
//! reserved_concurrent`, so nothing queues), each started at
//! `tokenize.large_body_nice` (10 by default). On a node whose CPUs are
//! busy, the kernel then gives tokio's workers, which answer every ordinary
//! Pick, about ten times these threads' share: ordinary routing keeps its
//! latency while large bodies take what is left. The pool is written here,
//! not taken from a crate, because its one property is the threads' nice
//! value, which tokio's blocking pool and rayon do not set.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

use super::TokenizeError;
use crate::sync::lock;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The pool: jobs go to whichever of its threads is free.
#[derive(Debug)]
pub struct Bulk {
    jobs: Mutex<Sender<Job>>,
    threads: usize,
    nice: i32,
}

impl Bulk {
    /// Starts `threads` threads (at least one) at nice value `nice` (0: the
    /// process's priority). A nice value the kernel refuses is logged once;
    /// the threads then run at the process's priority.
    pub fn start(threads: usize, nice: i32) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = threads.max(1);
        for i in 0..threads {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("indexd-bulk-{i}"))
                .spawn(move || worker(&rx, nice, i == 0))?;
        }
        Ok(Self {
            jobs: Mutex::new(tx),
            threads,
            nice,
        })
    }

    /// The number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Their nice value.
    pub fn nice(&self) -> i32 {
        self.nice
    }

    /// Runs `f` on the pool; its result. Dropping the future does not stop
    /// `f`: it should watch a cancel flag of its own.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TokenizeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        lock(&self.jobs).send(job).map_err(|_| {
            TokenizeError::Unavailable("the large-body threads are gone".to_owned())
        })?;
        rx.await.map_err(|_| {
            TokenizeError::Unavailable("a large-body thread dropped its job".to_owned())
        })
    }
}

fn worker(jobs: &Mutex<Receiver<Job>>, nice: i32, first: bool) {
    if nice != 0 {
        // On Linux the nice value is a thread's own: this thread's, by its id.
        let tid = rustix::thread::gettid();
        if let Err(e) = rustix::process::setpriority_process(Some(tid), nice)
            && first
        {
            tracing::warn!(nice, error = %e, "cannot lower the large-body threads' CPU priority: they run at indexd's");
        }
    }
    loop {
        // The lock is held only while waiting for the next job.
        let job = lock(jobs).recv();
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_on_threads_of_lower_priority() {
        let pool = Bulk::start(2, 7).unwrap();
        assert_eq!((pool.threads(), pool.nice()), (2, 7));
        let (name, nice) = pool
            .run(|| {
                let name = std::thread::current().name().map(str::to_owned);
                let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()));
                (name, nice.unwrap())
            })
            .await
            .unwrap();
        assert!(name.unwrap().starts_with("indexd-bulk-"));
        assert_eq!(nice, 7, "the job ran at the pool's nice value");
        // Both threads take jobs: two jobs that each wait for the other
        // finish only if they run at once.
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let (b1, b2) = (Arc::clone(&barrier), Arc::clone(&barrier));
        let (a, b) = tokio::join!(pool.run(move || b1.wait()), pool.run(move || b2.wait()));
        assert!(a.is_ok() && b.is_ok());
    }
}
