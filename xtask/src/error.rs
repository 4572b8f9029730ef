//! The one error type of every xtask command.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

/// Result alias used throughout xtask.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One kernel that failed to compile or link.
#[derive(Debug)]
pub struct CompileFailure {
    /// Workspace-relative path of the source, e.g. `kernels/dispatch.cu`.
    pub source: String,
    /// The command line that failed, ready to paste into a shell.
    pub command: String,
    /// Why it failed: the tool's stderr (and stdout), or the spawn error.
    pub output: String,
}

/// Everything an xtask command can fail with; each variant names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No nvcc in any of the places searched, and installing the pinned toolchain did not help.
    #[error(
        "nvcc not found. Searched, in order:\n{}{}\nSet CUDA_HOME to a CUDA 12/13 install, put nvcc on PATH, \
         or let `cargo xtask build-kernels` install the pinned PyPI toolchain (needs python3 with pip).",
        bullets(searched),
        install_note(install_error.as_deref())
    )]
    NvccNotFound {
        /// Every place looked at, with why it did not qualify.
        searched: Vec<String>,
        /// Why installing the pinned toolchain failed, when it was tried.
        install_error: Option<String>,
    },

    /// NVSHMEM kernels exist but no NVSHMEM headers/device library were found.
    #[error(
        "NVSHMEM (include/nvshmem.h and lib/libnvshmem_device.a) not found, needed for the nvshmem_cubin images of kernels/images.txt. \
         Searched, in order:\n{}{}",
        bullets(searched),
        install_note(install_error.as_deref())
    )]
    NvshmemNotFound {
        /// Every place looked at, with why it did not qualify.
        searched: Vec<String>,
        /// Why installing the pinned toolchain failed, when it was tried.
        install_error: Option<String>,
    },

    /// `nvlink` is needed for the NVSHMEM variants but is not next to nvcc nor on PATH.
    #[error(
        "nvlink not found next to {nvcc} nor on PATH; it is needed to device-link the nvshmem_cubin images of kernels/images.txt"
    )]
    NvlinkNotFound {
        /// The nvcc whose directory was searched.
        nvcc: PathBuf,
    },

    /// `nvcc --version` printed something that has no `release X.Y, VX.Y.Z` line.
    #[error(
        "`{nvcc} --version` did not print a line like `Cuda compilation tools, release 13.0, V13.0.88`; got:\n{output}"
    )]
    NvccVersionUnrecognised {
        /// The nvcc that was asked.
        nvcc: PathBuf,
        /// What it printed.
        output: String,
    },

    /// nvcc is too old to target sm_90a.
    #[error(
        "{nvcc} is CUDA {found}; building for sm_90a needs CUDA 12.0 or newer (13.0 is pinned)"
    )]
    NvccTooOld {
        /// The nvcc that was found.
        nvcc: PathBuf,
        /// Its version, `major.minor.patch`.
        found: String,
    },

    /// A program could not be started at all.
    #[error("could not run `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A program ran and exited unsuccessfully.
    #[error("`{command}` failed ({status}){}", indented_output(output))]
    CommandFailed {
        /// The command line.
        command: String,
        /// Exit status in words.
        status: String,
        /// Its stderr (or stdout), possibly empty.
        output: String,
    },

    /// A file-system operation on `path` failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "reading".
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// One or more kernels failed to compile; the others were built and recorded.
    #[error("{} kernel(s) failed to build:\n{}", failures.len(), describe_failures(failures))]
    KernelsFailed {
        /// One entry per failed source.
        failures: Vec<CompileFailure>,
    },

    /// `build-kernels --check` found artifacts that are missing or out of date.
    #[error(
        "{} kernel artifact(s) missing or out of date (run `cargo xtask build-kernels`):\n{}",
        stale.len(),
        bullets(stale)
    )]
    StaleKernels {
        /// `artifact (source): reason`, one per stale artifact.
        stale: Vec<String>,
    },

    /// A line of cargo's `--message-format=json` output was not JSON.
    #[error("cargo printed a line that is not a JSON message ({source}): {line}")]
    CargoJson {
        /// The offending line (truncated).
        line: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },

    /// The pack-device folder would exceed the size the GPU machine accepts.
    #[error(
        "the device pack in {} is {} bytes, over the {} byte limit; largest files:\n{}",
        out.display(), total, limit, bullets(largest)
    )]
    PackTooLarge {
        /// The pack folder.
        out: PathBuf,
        /// Its total size in bytes.
        total: u64,
        /// The limit in bytes.
        limit: u64,
        /// `name: size` for the largest files.
        largest: Vec<String>,
    },

    /// `--out` points at a non-empty folder that pack-device did not create.
    #[error(
        "refusing to clear {}: it is not empty and has no {marker} file, so it was not made by `cargo xtask pack-device`; \
         pass an empty or new folder to --out",
        out.display()
    )]
    OutNotAPack {
        /// The folder given as `--out`.
        out: PathBuf,
        /// The marker file name that was looked for.
        marker: &'static str,
    },

    /// `cargo build -p epcomm-cli` produced no `epcomm` executable.
    #[error("`{command}` finished but reported no executable for a bin target")]
    NoCliBinary {
        /// The cargo command.
        command: String,
    },
}

impl Error {
    /// Builds an [`Error::Io`] for `action` on `path`; use as `.map_err(Error::io("reading", p))`.
    pub fn io(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error + use<> {
        let path = path.to_path_buf();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    }
}

fn bullets(items: &[String]) -> String {
    let mut s = String::new();
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        let _ = write!(s, "  - {item}");
    }
    s
}

fn install_note(install_error: Option<&str>) -> String {
    match install_error {
        Some(e) => format!(
            "\nInstalling the pinned PyPI toolchain failed:\n{}",
            indent(e)
        ),
        None => String::new(),
    }
}

fn indented_output(output: &str) -> String {
    if output.trim().is_empty() {
        String::new()
    } else {
        format!(":\n{}", indent(output))
    }
}

fn describe_failures(failures: &[CompileFailure]) -> String {
    let mut s = String::new();
    for f in failures {
        let _ = writeln!(
            s,
            "--- {} ---\n$ {}\n{}",
            f.source,
            f.command,
            indent(&f.output)
        );
    }
    s
}

fn indent(text: &str) -> String {
    text.trim_end()
        .lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvcc_not_found_names_every_place_and_the_install_error() {
        let e = Error::NvccNotFound {
            searched: vec![
                "$CUDA_HOME/bin/nvcc (CUDA_HOME unset)".into(),
                "PATH".into(),
            ],
            install_error: Some("pip: no network".into()),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("  - $CUDA_HOME/bin/nvcc (CUDA_HOME unset)\n  - PATH"),
            "{msg}"
        );
        assert!(msg.contains("    pip: no network"), "{msg}");
    }

    #[test]
    fn compile_failures_show_command_and_output() {
        let e = Error::KernelsFailed {
            failures: vec![CompileFailure {
                source: "kernels/a.cu".into(),
                command: "nvcc a.cu".into(),
                output: "a.cu(3): error: expected a \";\"".into(),
            }],
        };
        let msg = e.to_string();
        assert!(msg.starts_with("1 kernel(s) failed"), "{msg}");
        assert!(
            msg.contains("--- kernels/a.cu ---\n$ nvcc a.cu\n    a.cu(3): error"),
            "{msg}"
        );
    }
}
