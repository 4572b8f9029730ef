//! The nvcc and nvlink command lines of each build kind, and running them: every stale image
//! is compiled on its own thread into a temporary file that is renamed into place only when
//! every step succeeded, so an artifact in the output directory is always whole.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::images::{KernelKind, KernelSource};
use crate::error::CompileFailure;
use crate::toolchain::{Nvshmem, Toolchain};
use crate::util::{self, combined_output, command_line, human_size, relative_to};

/// The nvcc and nvlink flags for one kind (without input and output paths).
///
/// Paths inside the workspace are workspace-relative (nvcc runs there), so the flags, and
/// thus the hashes, do not depend on where the checkout lives.
pub fn flags(
    kind: KernelKind,
    workspace: &Path,
    toolchain: &Toolchain,
    nvshmem: Option<&Nvshmem>,
) -> (Vec<String>, Vec<String>) {
    let mut nvcc = vec![
        "-O3".to_string(),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
        "-Ikernels".to_string(),
    ];
    match kind {
        KernelKind::Fatbin => {
            nvcc.extend(
                [
                    "-gencode",
                    "arch=compute_90a,code=sm_90a",
                    "-gencode",
                    "arch=compute_90,code=compute_90",
                    "--fatbin",
                ]
                .map(String::from),
            );
            (nvcc, Vec::new())
        }
        KernelKind::NvshmemCubin => {
            let mut link = vec!["-arch=sm_90a".to_string()];
            if let Some(n) = nvshmem {
                nvcc.push(format!("-I{}", relative_to(workspace, &n.include)));
                link.push(format!("-L{}", relative_to(workspace, &n.lib)));
            }
            if let Some(cccl) = &toolchain.cccl_include {
                nvcc.push(format!("-I{}", relative_to(workspace, cccl)));
            }
            nvcc.extend(["-rdc=true", "-cubin", "-arch=sm_90a"].map(String::from));
            link.push("-lnvshmem_device".to_string());
            (nvcc, link)
        }
    }
}

/// One image to compile: its manifest line and the flags [`flags`] gave for it.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    /// The image.
    pub src: &'a KernelSource,
    /// nvcc flags (without input and output paths).
    pub nvcc_flags: &'a [String],
    /// nvlink flags (empty for fatbins).
    pub link_flags: &'a [String],
}

/// What every compile shares.
#[derive(Debug)]
pub struct CompileCtx<'a> {
    /// The workspace root (nvcc runs there, so workspace paths in flags are relative).
    pub workspace: &'a Path,
    /// Where artifacts (and the transient relocatable cubins) are written.
    pub out_dir: &'a Path,
    /// nvcc and its version.
    pub toolchain: &'a Toolchain,
    /// nvlink; needed only when a job is an NVSHMEM cubin.
    pub nvlink: Option<&'a Path>,
    /// Print every command line.
    pub verbose: bool,
}

/// Compiles `jobs` on up to `available_parallelism` threads, each into
/// `<out_dir>/<artifact>`; returns each artifact's size or why it failed, in `jobs` order. A
/// failed job leaves no artifact and no temporary file behind, and does not stop the others.
pub fn compile_all(ctx: &CompileCtx<'_>, jobs: &[Job<'_>]) -> Vec<Result<u64, CompileFailure>> {
    let workers = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(jobs.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<u64, CompileFailure>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let r = compile_one(ctx, job);
                    let mut guard = results.lock().unwrap_or_else(|p| p.into_inner());
                    guard[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .zip(jobs)
        .map(|(r, job)| {
            r.unwrap_or_else(|| {
                Err(CompileFailure {
                    source: job.src.rel.clone(),
                    command: String::new(),
                    output: "the compile worker thread panicked".to_string(),
                })
            })
        })
        .collect()
}

/// Runs `cmd` (from the workspace root); on failure returns nvcc's output as the failure.
fn run_tool(
    ctx: &CompileCtx<'_>,
    src: &KernelSource,
    cmd: &mut Command,
) -> Result<(), CompileFailure> {
    cmd.current_dir(ctx.workspace);
    let line = command_line(cmd);
    if ctx.verbose {
        println!("  $ {line}");
    }
    let fail = |output: String| CompileFailure {
        source: src.rel.clone(),
        command: line.clone(),
        output,
    };
    let out = cmd
        .output()
        .map_err(|e| fail(format!("could not start: {e}")))?;
    let printed = combined_output(&out);
    if !out.status.success() {
        return Err(fail(format!("({}) {printed}", out.status)));
    }
    if !printed.is_empty() {
        // Warnings: always worth seeing.
        println!("{}:\n{printed}", src.rel);
    }
    Ok(())
}

/// Builds one artifact into a temporary file and renames it into place; returns its size.
fn compile_one(ctx: &CompileCtx<'_>, job: &Job<'_>) -> Result<u64, CompileFailure> {
    let started = Instant::now();
    let src = job.src;
    let out = ctx.out_dir.join(&src.artifact);
    let tmp = util::temp_sibling(&out);
    let io_fail = |what: &str, e: std::io::Error| CompileFailure {
        source: src.rel.clone(),
        command: String::new(),
        output: format!("{what}: {e}"),
    };
    match src.kind {
        KernelKind::Fatbin => {
            let mut cmd = Command::new(&ctx.toolchain.nvcc);
            cmd.args(job.nvcc_flags).arg(&src.rel).arg("-o").arg(&tmp);
            run_tool(ctx, src, &mut cmd).inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })?;
        }
        KernelKind::NvshmemCubin => {
            let rdc = ctx
                .out_dir
                .join(format!(".{}.rdc.{}.cubin", src.name, std::process::id()));
            let mut cmd = Command::new(&ctx.toolchain.nvcc);
            cmd.args(job.nvcc_flags).arg(&src.rel).arg("-o").arg(&rdc);
            let compiled = run_tool(ctx, src, &mut cmd);
            let linked = compiled.and_then(|()| {
                let nvlink = ctx.nvlink.ok_or_else(|| CompileFailure {
                    source: src.rel.clone(),
                    command: String::new(),
                    output: "nvlink was not resolved".to_string(),
                })?;
                let mut link = Command::new(nvlink);
                link.arg(&rdc).args(job.link_flags).arg("-o").arg(&tmp);
                run_tool(ctx, src, &mut link)
            });
            let _ = fs::remove_file(&rdc);
            linked.inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })?;
        }
    }
    fs::rename(&tmp, &out).map_err(|e| io_fail("moving the artifact into place", e))?;
    let size = fs::metadata(&out)
        .map_err(|e| io_fail("reading the artifact's size", e))?
        .len();
    println!(
        "  built {} -> {} ({}, {:.1} s)",
        src.rel,
        src.artifact,
        human_size(size),
        started.elapsed().as_secs_f64()
    );
    Ok(size)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::toolchain::{NvccOrigin, NvccVersion};

    fn fake_toolchain() -> Toolchain {
        Toolchain {
            nvcc: PathBuf::from("/x/nvcc"),
            origin: NvccOrigin::Path,
            version: NvccVersion {
                number: (13, 0, 88),
                text: "release 13.0, V13.0.88".into(),
            },
            cccl_include: None,
        }
    }

    #[test]
    fn flags_are_workspace_relative_and_follow_the_recipe() {
        let ws = Path::new("/ws");
        let mut tc = fake_toolchain();
        let (nvcc, link) = flags(KernelKind::Fatbin, ws, &tc, None);
        assert_eq!(
            nvcc.join(" "),
            "-O3 -std=c++17 -lineinfo -Ikernels -gencode arch=compute_90a,code=sm_90a \
             -gencode arch=compute_90,code=compute_90 --fatbin"
        );
        assert!(link.is_empty());
        tc.cccl_include = Some(PathBuf::from("/ws/target/tc/include/cccl"));
        let shmem = Nvshmem {
            include: PathBuf::from("/ws/target/tc/nvshmem/include"),
            lib: PathBuf::from("/opt/nvshmem/lib"),
            device_lib_sha256: String::new(),
        };
        let (nvcc, link) = flags(KernelKind::NvshmemCubin, ws, &tc, Some(&shmem));
        assert!(
            nvcc.contains(&"-Itarget/tc/nvshmem/include".to_string()),
            "{nvcc:?}"
        );
        assert!(
            nvcc.contains(&"-Itarget/tc/include/cccl".to_string()),
            "{nvcc:?}"
        );
        assert!(nvcc.ends_with(&["-rdc=true", "-cubin", "-arch=sm_90a"].map(String::from)));
        assert_eq!(
            link,
            ["-arch=sm_90a", "-L/opt/nvshmem/lib", "-lnvshmem_device"]
        );
    }
}
