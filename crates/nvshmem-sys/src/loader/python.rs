//! Step 5: asking `python3` for its site-packages directories, bounded in time.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{Origin, Searched};

/// The Python interpreter asked for its site-packages directories (step 5).
pub const PYTHON: &str = "python3";
/// How long `python3` may take to print its site-packages directories.
pub const PYTHON_TIMEOUT: Duration = Duration::from_secs(3);
/// The code run as `python3 -c`: prints one site-packages directory per line.
pub const PYTHON_SITE_QUERY: &str =
    "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))";

/// Where step 5 gets its site-packages directories from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SitePackages {
    /// Run `python -c` [`PYTHON_SITE_QUERY`], waiting at most `timeout`; only done when the
    /// earlier steps found nothing.
    Ask {
        /// The interpreter, looked up on `PATH` unless it has a `/`.
        python: OsString,
        /// How long it may take.
        timeout: Duration,
    },
    /// These directories (for callers and tests that know them).
    Known(Vec<PathBuf>),
    /// Skip step 5.
    Skip,
}

impl SitePackages {
    /// The site-packages directories of step 5: asked of `python` ([`SitePackages::Ask`]), as
    /// given, or none. When asking yields none, `searched` gets a line saying why.
    pub(super) fn resolve(&self, searched: &mut Vec<Searched>) -> Vec<PathBuf> {
        match self {
            SitePackages::Ask { python, timeout } => match python_site_packages(python, *timeout) {
                Ok(dirs) => {
                    if dirs.is_empty() {
                        searched.push(Searched {
                            origin: Origin::PythonSitePackages,
                            path: None,
                            outcome: format!("{} reported none", python.to_string_lossy()),
                        });
                    }
                    dirs
                }
                Err(why) => {
                    searched.push(Searched {
                        origin: Origin::PythonSitePackages,
                        path: None,
                        outcome: format!("could not ask {}: {why}", python.to_string_lossy()),
                    });
                    Vec::new()
                }
            },
            SitePackages::Known(dirs) => dirs.clone(),
            SitePackages::Skip => Vec::new(),
        }
    }
}

/// The site-packages directories in `python3 -c` [`PYTHON_SITE_QUERY`]'s output: one per
/// non-blank line.
pub fn parse_site_packages(output: &str) -> Vec<PathBuf> {
    output
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// Asks `python` for its site-packages directories (`python -c` [`PYTHON_SITE_QUERY`]),
/// waiting at most `timeout`.
///
/// # Errors
/// Why there is no answer: the interpreter could not be started, did not finish in time (it is
/// then killed), exited unsuccessfully, or printed something that is not UTF-8.
pub fn python_site_packages(python: &OsStr, timeout: Duration) -> Result<Vec<PathBuf>, String> {
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(PYTHON_SITE_QUERY);
    run_with_timeout(cmd, timeout).map(|out| parse_site_packages(&out))
}

/// Runs `cmd` (stdin and stderr to /dev/null) and returns its standard output, killing it when
/// it takes longer than `timeout`.
fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Result<String, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let Some(mut stdout) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("no standard output".to_string());
    };
    // A thread drains the pipe, so neither a full pipe nor a process that leaves a child
    // holding it open can block the caller beyond `timeout`.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let read = stdout.read_to_end(&mut bytes).map(|_| bytes);
        let _ = tx.send(read);
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {} ms", timeout.as_millis()));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.to_string());
            }
        }
    };
    if !status.success() {
        return Err(format!("exited with {status}"));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left.max(Duration::from_millis(100))) {
        Ok(Ok(bytes)) => String::from_utf8(bytes).map_err(|_| "printed non-UTF-8 output".into()),
        Ok(Err(e)) => Err(format!("reading its output: {e}")),
        Err(_) => Err("its output did not end".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn site_packages_output_is_one_directory_per_line() {
        assert_eq!(
            parse_site_packages("/a/site-packages\r\n  \n/b/dist-packages\n"),
            [
                PathBuf::from("/a/site-packages"),
                PathBuf::from("/b/dist-packages")
            ]
        );
        assert!(parse_site_packages("").is_empty());
    }

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script);
        cmd
    }

    #[test]
    fn asking_a_program_is_bounded_and_failures_are_reported() {
        let out = run_with_timeout(sh("printf '/a\\n/b\\n'"), Duration::from_secs(5)).unwrap();
        assert_eq!(
            parse_site_packages(&out),
            [Path::new("/a"), Path::new("/b")]
        );
        let err = run_with_timeout(sh("exit 3"), Duration::from_secs(5)).unwrap_err();
        assert!(err.contains("exited"), "{err}");
        let start = Instant::now();
        let err = run_with_timeout(sh("exec sleep 5"), Duration::from_millis(200)).unwrap_err();
        assert!(err.contains("no answer within 200 ms"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10));
        let err =
            python_site_packages(OsStr::new("/nonexistent/python3"), PYTHON_TIMEOUT).unwrap_err();
        assert!(!err.is_empty());
    }

    #[test]
    fn python3_answers_with_absolute_directories_when_present() {
        match python_site_packages(OsStr::new(PYTHON), Duration::from_secs(20)) {
            Ok(dirs) => {
                assert!(!dirs.is_empty());
                assert!(dirs.iter().all(|d| d.is_absolute()), "{dirs:?}");
            }
            Err(why) => eprintln!("python3 not usable here ({why}); nothing to check"),
        }
    }
}
