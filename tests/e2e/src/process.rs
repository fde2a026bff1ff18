//! Child processes that cannot outlive their test.
//!
//! Each child runs in its own process group with its stdout and stderr in a
//! log file. Dropping the [`Spawned`] kills the whole group and reaps it; if
//! the test process itself dies, the kernel sends the child `SIGKILL`
//! (`PR_SET_PDEATHSIG`). When the owning thread is panicking — a failed test —
//! the drop prints the tail of the log first.

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::HarnessError;

/// How much of a log a failed test prints.
const LOG_TAIL_BYTES: u64 = 16 * 1024;

/// A running child process, killed with its process group on drop.
#[derive(Debug)]
pub struct Spawned {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Spawned {
    /// Starts `command` with stdout and stderr appended to `log`.
    pub fn start(name: &str, mut command: Command, log: &Path) -> Result<Self, HarnessError> {
        let out = File::create(log)
            .map_err(|e| HarnessError::io(format!("create {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| HarnessError::io("clone log handle", e))?;
        command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        die_with_parent(&mut command);
        let child = command
            .spawn()
            .map_err(|e| HarnessError::io(format!("spawn {name}"), e))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log: log.to_path_buf(),
        })
    }

    /// The process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name given at start.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// The last part of the process's log.
    pub fn log_tail(&self) -> String {
        read_tail(&self.log, LOG_TAIL_BYTES)
    }

    /// The log file's path.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Kills the process group and waits for the leader.
    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            kill_group(self.child.id());
        }
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "----- log of {} ({}) -----\n{}\n----- end of log of {} -----",
                self.name,
                self.log.display(),
                self.log_tail(),
                self.name
            );
        }
    }
}

fn read_tail(path: &Path, max: u64) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut buf = Vec::new();
    if len > max {
        use std::io::Seek;
        let _ = file.seek(std::io::SeekFrom::Start(len - max));
    }
    let _ = file.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

#[allow(unsafe_code)]
fn kill_group(pid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: killpg only sends a signal; the group is the child's own
    // (`process_group(0)` at spawn), never ours.
    unsafe {
        libc::killpg(pgid, libc::SIGKILL);
    }
}

#[allow(unsafe_code)]
fn die_with_parent(command: &mut Command) {
    // SAFETY: the closure runs between fork and exec and calls only prctl,
    // which is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
