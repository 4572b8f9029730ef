//! Small helpers shared by the commands: running programs, paths, hashing.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Renders `cmd` as a shell-like line for messages (arguments with spaces are quoted).
pub fn command_line(cmd: &Command) -> String {
    let mut parts = vec![quote(cmd.get_program())];
    parts.extend(cmd.get_args().map(quote));
    parts.join(" ")
}

fn quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` to completion, capturing stdout and stderr.
///
/// Returns the output when the program exits with status 0, [`Error::Spawn`] when it cannot be
/// started and [`Error::CommandFailed`] (with its stderr, or stdout when stderr is empty) otherwise.
pub fn run_captured(cmd: &mut Command) -> Result<Output> {
    let line = command_line(cmd);
    let out = cmd.output().map_err(|source| Error::Spawn {
        command: line.clone(),
        source,
    })?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(Error::CommandFailed {
            command: line,
            status: out.status.to_string(),
            output: combined_output(&out),
        })
    }
}

/// Runs `cmd` with inherited stdio (the user sees its output live); fails unless it exits 0.
pub fn run_inherited(cmd: &mut Command) -> Result<()> {
    let line = command_line(cmd);
    let status = cmd.status().map_err(|source| Error::Spawn {
        command: line.clone(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::CommandFailed {
            command: line,
            status: status.to_string(),
            output: "(its output is above)".to_string(),
        })
    }
}

/// stderr followed by stdout of a finished program, each only when non-empty.
pub fn combined_output(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    match (stderr.trim().is_empty(), stdout.trim().is_empty()) {
        (false, false) => format!("{}\n{}", stderr.trim_end(), stdout.trim_end()),
        (false, true) => stderr.trim_end().to_string(),
        (true, false) => stdout.trim_end().to_string(),
        (true, true) => String::new(),
    }
}

/// `path` relative to `base` when it lies inside it, else unchanged; used so that flags and
/// manifests do not depend on where the checkout lives.
pub fn relative_to(base: &Path, path: &Path) -> String {
    path.strip_prefix(base)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| path.to_string_lossy().into_owned())
}

/// Whether `path` is a regular file with an execute bit (any file, on non-Unix).
pub fn is_executable(path: &Path) -> bool {
    let Ok(meta) = fs::metadata(path) else {
        return false;
    };
    if !meta.is_file() {
        return false;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        true
    }
}

/// First executable named `name` in the directories of a PATH-style list.
pub fn find_in_path(name: &str, path_var: Option<&OsStr>) -> Option<PathBuf> {
    let path_var = path_var?;
    std::env::split_paths(path_var)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// Lower-case hex of a byte string.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// SHA-256 of a file's content, in hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let bytes = fs::read(path).map_err(Error::io("reading", path))?;
    Ok(hex(&Sha256::digest(&bytes)))
}

/// Writes `contents` to `path` through a temporary sibling and a rename, so readers never see a
/// half-written file.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let tmp = temp_sibling(path);
    fs::write(&tmp, contents).map_err(Error::io("writing", &tmp))?;
    fs::rename(&tmp, path).map_err(Error::io("renaming into place", path))
}

/// A hidden, process-unique temporary path next to `path`.
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Human size: `5.6 KiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Panics, showing `text`, unless it contains every one of `fragments` (tests only).
#[cfg(test)]
#[track_caller]
pub fn assert_contains_all(text: &str, fragments: &[&str]) {
    for fragment in fragments {
        assert!(text.contains(fragment), "missing {fragment:?} in:\n{text}");
    }
}

/// A directory under the system temp dir, removed with everything in it on drop (tests only).
#[cfg(test)]
#[derive(Debug)]
pub struct TempDir(PathBuf);

#[cfg(test)]
impl TempDir {
    /// Creates a fresh, empty directory whose name contains `tag`.
    pub fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("xtask-{tag}-{}-{n}-{nanos}", std::process::id()));
        fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `contents` to `rel` inside the directory, creating parents.
    pub fn write(&self, rel: &str, contents: &str) -> PathBuf {
        let p = self.0.join(rel);
        fs::create_dir_all(p.parent().expect("has parent")).expect("create parents");
        fs::write(&p, contents).expect("write file");
        p
    }

    /// Creates an executable shell script at `rel` that runs `body`.
    #[cfg(unix)]
    pub fn write_script(&self, rel: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let p = self.write(rel, &format!("#!/bin/sh\n{body}\n"));
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }
}

#[cfg(test)]
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_matches_known_sha256() {
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn command_line_quotes_only_when_needed() {
        let mut c = Command::new("nvcc");
        c.args(["-O3", "-Ia b", "it's"]);
        assert_eq!(command_line(&c), r"nvcc -O3 '-Ia b' 'it'\''s'");
    }

    #[test]
    fn relative_to_strips_only_inside_paths() {
        let base = Path::new("/ws");
        assert_eq!(
            relative_to(base, Path::new("/ws/kernels/a.cu")),
            "kernels/a.cu"
        );
        assert_eq!(
            relative_to(base, Path::new("/opt/cuda/include")),
            "/opt/cuda/include"
        );
    }

    #[cfg(unix)]
    #[test]
    fn find_in_path_skips_non_executables_and_keeps_order() {
        let t = TempDir::new("path");
        t.write("a/nvcc", "not executable");
        let b = t.write_script("b/nvcc", "true");
        t.write_script("c/nvcc", "true");
        let path =
            std::env::join_paths([t.path().join("a"), t.path().join("b"), t.path().join("c")])
                .expect("join");
        assert_eq!(find_in_path("nvcc", Some(&path)), Some(b));
        assert_eq!(find_in_path("nvcc", None), None);
    }

    #[test]
    fn run_captured_reports_status_and_stderr() {
        let err = run_captured(Command::new("sh").args(["-c", "echo boom >&2; exit 3"]))
            .expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains("exit status: 3"), "{msg}");
        assert!(msg.contains("boom"), "{msg}");
        let err = run_captured(&mut Command::new("/nonexistent/xtask-prog")).expect_err("spawn");
        assert!(matches!(err, Error::Spawn { .. }), "{err}");
    }

    #[test]
    fn write_atomic_replaces_content() {
        let t = TempDir::new("atomic");
        let p = t.path().join("m.json");
        write_atomic(&p, b"one").expect("write");
        write_atomic(&p, b"two").expect("write");
        assert_eq!(fs::read_to_string(&p).expect("read"), "two");
        assert_eq!(
            fs::read_dir(t.path()).expect("ls").count(),
            1,
            "no temp file left behind"
        );
    }

    #[test]
    #[should_panic(expected = "missing \"two\" in:\none three")]
    fn assert_contains_all_names_the_missing_fragment() {
        assert_contains_all("one three", &["one", "two", "three"]);
    }

    #[test]
    fn human_size_units() {
        assert_eq!(human_size(10), "10 B");
        assert_eq!(human_size(5734), "5.6 KiB");
        assert_eq!(human_size(3 * 1024 * 1024), "3.0 MiB");
    }
}
