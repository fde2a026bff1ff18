//! Child processes that cannot outlive their test.
//!
//! Each child runs in its own process group with its stdout and stderr in a
//! log file. Dropping the [`Spawned`] kills its whole process tree (its group
//! and every descendant, which may have made groups of their own, as vLLM's
//! engine processes do) and reaps it. If the thread that started the child
//! exits, the kernel sends the child `SIGKILL` (`PR_SET_PDEATHSIG`): start
//! children from the thread that owns them. When the owning thread is
//! panicking — a failed test — the drop prints the tail of the log first.

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

    /// Kills the process tree and waits for the leader.
    pub fn stop(&mut self) {
        kill_tree(self.child.id());
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

/// Kills `root` (a [`Spawned`] child's pid, also its group) and every
/// descendant, without reaping: for a signal handler that must not leave a
/// child's tree behind when the process exits without running destructors.
pub fn kill_tree(root: u32) {
    // Descendants first collected, then killed: once the leader dies they
    // are re-parented and cannot be found by parentage any more.
    let mut tree = descendants(root);
    tree.push(root);
    for pid in &tree {
        kill_group(*pid);
        kill(*pid);
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

/// Every process whose parent chain leads to `root` (from `/proc`), `root`
/// excluded.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let after = stat.rsplit_once(')')?.1;
            let ppid = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while let Some(&parent) = found.get(i) {
        for (pid, ppid) in &parents {
            if *ppid == parent && !found.contains(pid) {
                found.push(*pid);
            }
        }
        i += 1;
    }
    found.retain(|p| *p != root);
    found
}

#[allow(unsafe_code)]
fn kill(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill only sends a signal, to a process of this child's tree.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
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
