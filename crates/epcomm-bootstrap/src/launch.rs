//! Local multi-process launcher: starts one child per rank on this machine with the
//! torchrun-style variables [`crate::BootstrapConfig::from_env`] reads, and supervises them.
//!
//! The children do not outlive the launcher: dropping the [`LaunchedGroup`] kills them, and on
//! Linux a launcher that dies without dropping it (killed, or `exit` without destructors) takes
//! them with it (each child asks the kernel for `SIGKILL` when the thread that spawned it
//! exits: spawn and wait from one thread that lives as long as the group).
//!
//! ```no_run
//! use std::time::Duration;
//! use epcomm_bootstrap::launch::{LocalLaunch, Output};
//!
//! let mut group = LocalLaunch::new("/path/to/worker", ["--flag"])
//!     .world_size(4)
//!     .env("EPCOMM_BOOTSTRAP_TIMEOUT_MS", "5000")
//!     .output(Output::Capture)
//!     .spawn()?;
//! let statuses = group.wait(Duration::from_secs(60))?;
//! assert!(statuses.iter().all(|s| s.success()));
//! # Ok::<(), epcomm_bootstrap::launch::LaunchError>(())
//! ```

use std::ffi::{OsStr, OsString};
use std::io::{self, Read};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often [`LaunchedGroup::wait`] polls the children.
const POLL: Duration = Duration::from_millis(10);
/// Bytes of stderr quoted in a [`RankFailure`].
const STDERR_TAIL: usize = 4096;

/// Errors of the launcher; each names the rank(s) concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// No free TCP port could be obtained from the OS.
    #[error("cannot obtain a free TCP port on 127.0.0.1: {source}")]
    FreePort {
        /// The bind error.
        #[source]
        source: io::Error,
    },
    /// A builder argument breaks a rule.
    #[error("invalid launch argument `{argument}`: {rule}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// The rule broken.
        rule: String,
    },
    /// A child could not be started (the ranks started before it are killed).
    #[error("cannot spawn rank {rank} ({program:?}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: OsString,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Polling a child failed.
    #[error("cannot wait for rank {rank}: {source}")]
    Wait {
        /// The rank.
        rank: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// One or more ranks exited unsuccessfully; the others were killed.
    #[error("{}", describe_failures(failures, killed))]
    RanksFailed {
        /// The ranks that failed on their own, ascending.
        failures: Vec<RankFailure>,
        /// Ranks that were still running and got killed.
        killed: Vec<usize>,
    },
    /// The group did not finish in time; the ranks still running were killed.
    #[error("launch timed out after {waited:?}: rank(s) {running:?} still running were killed")]
    Timeout {
        /// How long [`LaunchedGroup::wait`] waited.
        waited: Duration,
        /// Ranks that had not exited.
        running: Vec<usize>,
    },
}

/// A rank that exited unsuccessfully.
#[derive(Debug, Clone)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// Its exit status (code or signal).
    pub status: ExitStatus,
    /// The end of its stderr, when output is captured.
    pub stderr_tail: Option<String>,
}

fn describe_failures(failures: &[RankFailure], killed: &[usize]) -> String {
    let mut s = String::from("rank(s) failed:");
    for f in failures {
        s.push_str(&format!(" rank {} ({})", f.rank, f.status));
        if let Some(tail) = &f.stderr_tail
            && !tail.trim().is_empty()
        {
            s.push_str(&format!(
                "\n--- rank {} stderr (tail) ---\n{}",
                f.rank,
                tail.trim_end()
            ));
        }
    }
    if !killed.is_empty() {
        s.push_str(&format!("\nkilled remaining rank(s) {killed:?}"));
    }
    s
}

/// Returns a TCP port that was free on 127.0.0.1 a moment ago (bind port 0, read, release).
///
/// Another process may take it before it is used; callers that can tolerate a retry should.
pub fn free_port() -> Result<u16, LaunchError> {
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).map_err(|source| LaunchError::FreePort { source })?;
    let port = listener
        .local_addr()
        .map_err(|source| LaunchError::FreePort { source })?
        .port();
    Ok(port)
}

/// Runs `f` on `world` ranks that are threads of this process, each with its own
/// [`crate::Bootstrap`] connected over 127.0.0.1 ([`crate::BootstrapConfig::single_host`],
/// `timeout` bounding every wait), and returns each rank's outcome in rank order: `f`'s value,
/// or the error of a bootstrap that could not connect. A panic in `f` is resumed here. For
/// tests and one-process tools; a multi-process job uses [`LocalLaunch`].
///
/// # Errors
/// [`LaunchError::FreePort`] when no port is free.
pub fn on_threads<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(crate::Bootstrap) -> T + Send + Sync + Clone + 'static,
) -> Result<Vec<crate::Result<T>>, LaunchError> {
    let port = free_port()?;
    let threads: Vec<JoinHandle<crate::Result<T>>> = (0..world)
        .map(|rank| {
            let f = f.clone();
            thread::spawn(move || {
                let cfg = crate::BootstrapConfig::single_host(port, rank, world, timeout);
                crate::Bootstrap::connect(cfg).map(f)
            })
        })
        .collect();
    Ok(threads
        .into_iter()
        .map(|t| {
            t.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
        .collect())
}

/// What to do with the children's stdout and stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// Children write to this process's stdout/stderr.
    #[default]
    Inherit,
    /// Collected in memory; see [`LaunchedGroup::output`].
    Capture,
    /// Discarded.
    Null,
}

/// Builder for a group of local processes, one per rank.
///
/// Every child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (= rank), `LOCAL_WORLD_SIZE`
/// (= world size), `MASTER_ADDR=127.0.0.1` and `MASTER_PORT`, then the variables added with
/// [`LocalLaunch::env`] and [`LocalLaunch::rank_env`] (which may override them). The rest of the
/// environment is inherited; `CUDA_VISIBLE_DEVICES` is neither set nor cleared, so each process
/// sees the same GPUs and picks its own by local rank.
#[derive(Debug, Clone)]
pub struct LocalLaunch {
    program: OsString,
    args: Vec<OsString>,
    world_size: usize,
    env: Vec<(OsString, OsString)>,
    rank_env: Vec<(usize, OsString, OsString)>,
    ranks: Option<Vec<usize>>,
    master_port: Option<u16>,
    output: Output,
}

impl LocalLaunch {
    /// A launch of `program args...`, world size 1, output inherited.
    pub fn new<I, S>(program: impl AsRef<OsStr>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        LocalLaunch {
            program: program.as_ref().to_os_string(),
            args: args
                .into_iter()
                .map(|a| a.as_ref().to_os_string())
                .collect(),
            world_size: 1,
            env: Vec::new(),
            rank_env: Vec::new(),
            ranks: None,
            master_port: None,
            output: Output::Inherit,
        }
    }

    /// Number of ranks (must be at least 1).
    pub fn world_size(mut self, n: usize) -> Self {
        self.world_size = n;
        self
    }

    /// Sets a variable for every child.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    /// Sets a variable for one rank only (applied after [`LocalLaunch::env`]).
    pub fn rank_env(
        mut self,
        rank: usize,
        key: impl AsRef<OsStr>,
        value: impl AsRef<OsStr>,
    ) -> Self {
        self.rank_env.push((
            rank,
            key.as_ref().to_os_string(),
            value.as_ref().to_os_string(),
        ));
        self
    }

    /// Starts only these ranks (default: all of `0..world_size`); for fault-injection tests
    /// where some rank never arrives.
    pub fn ranks(mut self, ranks: impl IntoIterator<Item = usize>) -> Self {
        self.ranks = Some(ranks.into_iter().collect());
        self
    }

    /// Uses this coordinator port instead of [`free_port`].
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }

    /// Chooses what happens to the children's stdout/stderr.
    pub fn output(mut self, output: Output) -> Self {
        self.output = output;
        self
    }

    /// Starts the children. If one cannot be started, those already started are killed.
    pub fn spawn(self) -> Result<LaunchedGroup, LaunchError> {
        if self.world_size == 0 {
            return Err(LaunchError::InvalidArgument {
                argument: "world_size",
                rule: "must be at least 1".into(),
            });
        }
        let mut ranks = self
            .ranks
            .clone()
            .unwrap_or_else(|| (0..self.world_size).collect());
        ranks.sort_unstable();
        ranks.dedup();
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(LaunchError::InvalidArgument {
                argument: "ranks",
                rule: format!("rank {bad} is not below world_size {}", self.world_size),
            });
        }
        if let Some((bad, _, _)) = self.rank_env.iter().find(|(r, _, _)| *r >= self.world_size) {
            return Err(LaunchError::InvalidArgument {
                argument: "rank_env",
                rule: format!("rank {bad} is not below world_size {}", self.world_size),
            });
        }
        let master_port = match self.master_port {
            Some(0) => {
                return Err(LaunchError::InvalidArgument {
                    argument: "master_port",
                    rule: "must be in 1..=65535".into(),
                });
            }
            Some(p) => p,
            None => free_port()?,
        };
        let mut group = LaunchedGroup {
            procs: Vec::new(),
            master_port,
        };
        for rank in ranks {
            let mut cmd = Command::new(&self.program);
            cmd.args(&self.args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", self.world_size.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", self.world_size.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", master_port.to_string());
            for (k, v) in &self.env {
                cmd.env(k, v);
            }
            for (_, k, v) in self.rank_env.iter().filter(|(r, _, _)| *r == rank) {
                cmd.env(k, v);
            }
            let (out, err) = match self.output {
                Output::Inherit => (Stdio::inherit(), Stdio::inherit()),
                Output::Capture => (Stdio::piped(), Stdio::piped()),
                Output::Null => (Stdio::null(), Stdio::null()),
            };
            cmd.stdin(Stdio::null()).stdout(out).stderr(err);
            die_with_launcher(&mut cmd);
            let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
                rank,
                program: self.program.clone(),
                source,
            })?;
            let stdout = child.stdout.take().map(Capture::start);
            let stderr = child.stderr.take().map(Capture::start);
            group.procs.push(RankProc {
                rank,
                child,
                status: None,
                stdout,
                stderr,
            });
        }
        Ok(group)
    }
}

/// Makes the child of `cmd` receive `SIGKILL` when the thread spawning it exits (Linux), so
/// that a rank never outlives a launcher that was killed: it would keep a GPU busy, and its
/// peers' waits would name a launcher that is gone. Elsewhere: nothing.
fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = std::process::id();
        // SAFETY: the closure runs in the child between fork and exec and only makes two
        // async-signal-safe system calls (prctl, getppid); it allocates nothing (the errors
        // are OS error codes).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The launcher may have died before the request took effect.
                if libc::getppid() as u32 != launcher {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// A pipe drained by a background thread into a shared buffer.
#[derive(Debug)]
struct Capture {
    buf: Arc<Mutex<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
}

impl Capture {
    fn start(mut pipe: impl Read + Send + 'static) -> Capture {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let thread = thread::Builder::new()
            .name("epcomm-launch-capture".into())
            .spawn(move || {
                let mut chunk = [0u8; 8192];
                loop {
                    match pipe.read(&mut chunk) {
                        Ok(0) => break,
                        Ok(n) => sink
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .extend_from_slice(&chunk[..n]),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            })
            .ok();
        Capture { buf, thread }
    }

    /// Waits up to `limit` for the pipe to reach end-of-file (the child has exited), then
    /// returns everything read so far.
    fn contents(&mut self, limit: Duration) -> Vec<u8> {
        let deadline = Instant::now() + limit;
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(2));
        }
        if self.thread.as_ref().is_some_and(|t| t.is_finished())
            && let Some(t) = self.thread.take()
        {
            let _ = t.join();
        }
        self.buf
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[derive(Debug)]
struct RankProc {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    stdout: Option<Capture>,
    stderr: Option<Capture>,
}

/// Captured output of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankOutput {
    /// The rank.
    pub rank: usize,
    /// Everything it wrote to stdout.
    pub stdout: Vec<u8>,
    /// Everything it wrote to stderr.
    pub stderr: Vec<u8>,
}

/// Running children of a [`LocalLaunch`]. Dropping it kills and reaps any still running.
#[derive(Debug)]
pub struct LaunchedGroup {
    procs: Vec<RankProc>,
    master_port: u16,
}

impl LaunchedGroup {
    /// The `MASTER_PORT` given to the children.
    pub fn master_port(&self) -> u16 {
        self.master_port
    }

    /// The ranks started, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        self.procs.iter().map(|p| p.rank).collect()
    }

    /// Process ids of the children, in rank order.
    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(|p| p.child.id()).collect()
    }

    /// Waits for every child to exit, at most `timeout`.
    ///
    /// Returns the exit statuses in rank order when all succeed. As soon as one rank exits
    /// unsuccessfully, the still-running ranks are killed and [`LaunchError::RanksFailed`]
    /// names the failed rank(s) with their exit status (and stderr tail when captured). When
    /// the timeout expires, the running ranks are killed and [`LaunchError::Timeout`] names
    /// them.
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<ExitStatus>, LaunchError> {
        let start = Instant::now();
        loop {
            let mut failed = false;
            for p in &mut self.procs {
                if p.status.is_none() {
                    let status = p.child.try_wait().map_err(|source| LaunchError::Wait {
                        rank: p.rank,
                        source,
                    })?;
                    if let Some(s) = status {
                        failed |= !s.success();
                        p.status = Some(s);
                    }
                }
            }
            if failed {
                let failures: Vec<(usize, ExitStatus)> = self
                    .procs
                    .iter()
                    .filter_map(|p| p.status.filter(|s| !s.success()).map(|s| (p.rank, s)))
                    .collect();
                let killed = self.kill_all();
                let failures = failures
                    .into_iter()
                    .map(|(rank, status)| {
                        let stderr_tail = self
                            .procs
                            .iter_mut()
                            .find(|p| p.rank == rank)
                            .and_then(|p| p.stderr.as_mut())
                            .map(|c| tail(&c.contents(Duration::from_millis(500))));
                        RankFailure {
                            rank,
                            status,
                            stderr_tail,
                        }
                    })
                    .collect();
                return Err(LaunchError::RanksFailed { failures, killed });
            }
            if self.procs.iter().all(|p| p.status.is_some()) {
                return Ok(self.procs.iter().filter_map(|p| p.status).collect());
            }
            if start.elapsed() >= timeout {
                let running = self.kill_all();
                return Err(LaunchError::Timeout {
                    waited: start.elapsed(),
                    running,
                });
            }
            thread::sleep(POLL);
        }
    }

    /// Kills and reaps every child still running; returns their ranks.
    pub fn kill_all(&mut self) -> Vec<usize> {
        let mut killed = Vec::new();
        for p in &mut self.procs {
            if p.status.is_none() {
                if let Ok(Some(s)) = p.child.try_wait() {
                    p.status = Some(s);
                    continue;
                }
                let _ = p.child.kill();
                p.status = p.child.wait().ok();
                killed.push(p.rank);
            }
        }
        killed
    }

    /// Captured output of each rank (empty when output is not [`Output::Capture`]). Call after
    /// [`LaunchedGroup::wait`]; output of a child still running is what it has written so far.
    pub fn output(&mut self) -> Vec<RankOutput> {
        self.procs
            .iter_mut()
            .map(|p| {
                let limit = if p.status.is_some() {
                    Duration::from_secs(1)
                } else {
                    Duration::ZERO
                };
                RankOutput {
                    rank: p.rank,
                    stdout: p
                        .stdout
                        .as_mut()
                        .map(|c| c.contents(limit))
                        .unwrap_or_default(),
                    stderr: p
                        .stderr
                        .as_mut()
                        .map(|c| c.contents(limit))
                        .unwrap_or_default(),
                }
            })
            .collect()
    }
}

impl Drop for LaunchedGroup {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn tail(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(STDERR_TAIL);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> LocalLaunch {
        LocalLaunch::new("/bin/sh", ["-c", script])
    }

    #[test]
    fn free_port_is_bindable() {
        let port = free_port().unwrap();
        assert_ne!(port, 0);
        TcpListener::bind(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn children_get_rank_variables_and_output_is_captured() {
        let mut g = sh("echo \"$RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR/$MASTER_PORT/$EXTRA\"; echo err >&2")
            .world_size(3)
            .env("EXTRA", "x")
            .rank_env(1, "EXTRA", "y")
            .master_port(4242)
            .output(Output::Capture)
            .spawn()
            .unwrap();
        let statuses = g.wait(Duration::from_secs(20)).unwrap();
        assert_eq!(statuses.len(), 3);
        let out = g.output();
        for (rank, o) in out.iter().enumerate() {
            let extra = if rank == 1 { "y" } else { "x" };
            assert_eq!(
                String::from_utf8_lossy(&o.stdout),
                format!("{rank}/3/{rank}/3/127.0.0.1/4242/{extra}\n")
            );
            assert_eq!(o.stderr, b"err\n");
        }
    }

    #[test]
    fn failing_rank_is_named_and_others_killed() {
        let mut g = sh("if [ \"$RANK\" = 1 ]; then echo boom >&2; exit 3; fi; sleep 30")
            .world_size(3)
            .output(Output::Capture)
            .spawn()
            .unwrap();
        let start = Instant::now();
        match g.wait(Duration::from_secs(20)).unwrap_err() {
            LaunchError::RanksFailed { failures, killed } => {
                assert_eq!(failures.len(), 1);
                assert_eq!(failures[0].rank, 1);
                assert_eq!(failures[0].status.code(), Some(3));
                assert_eq!(failures[0].stderr_tail.as_deref(), Some("boom\n"));
                assert_eq!(killed, vec![0, 2]);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn timeout_kills_running_ranks() {
        let mut g = sh("if [ \"$RANK\" = 0 ]; then exit 0; fi; sleep 30")
            .world_size(2)
            .output(Output::Null)
            .spawn()
            .unwrap();
        match g.wait(Duration::from_millis(300)).unwrap_err() {
            LaunchError::Timeout { running, .. } => assert_eq!(running, vec![1]),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn subset_of_ranks_and_argument_checks() {
        let mut g = sh("exit 0")
            .world_size(4)
            .ranks([3, 1])
            .output(Output::Null)
            .spawn()
            .unwrap();
        assert_eq!(g.ranks(), vec![1, 3]);
        assert_eq!(g.wait(Duration::from_secs(20)).unwrap().len(), 2);
        assert!(matches!(
            sh("true").world_size(0).spawn(),
            Err(LaunchError::InvalidArgument {
                argument: "world_size",
                ..
            })
        ));
        assert!(matches!(
            sh("true").world_size(2).ranks([2]).spawn(),
            Err(LaunchError::InvalidArgument {
                argument: "ranks",
                ..
            })
        ));
        assert!(matches!(
            LocalLaunch::new("/nonexistent/program", Vec::<String>::new()).spawn(),
            Err(LaunchError::Spawn { rank: 0, .. })
        ));
    }

    #[test]
    fn ranks_as_threads_gather_in_rank_order() {
        let out = on_threads(3, Duration::from_secs(20), |b| {
            let all = b
                .all_gather("threads", &[b.rank() as u8])
                .expect("all_gather");
            (b.rank(), all)
        })
        .expect("a free port");
        for (r, res) in out.into_iter().enumerate() {
            let (rank, all) = res.expect("connected");
            assert_eq!(rank, r);
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        }
    }
}
