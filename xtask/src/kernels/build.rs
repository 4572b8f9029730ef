//! The build driver: reads the image manifest and the build record, decides what is stale,
//! compiles that (or, with `--check`, only reports it), removes the artifacts whose image is
//! gone, and saves the record.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;

use super::Paths;
use super::images::{IMAGES_FILE, KernelKind, KernelSource, read_images};
use super::inputs::{HashInputs, inputs_hash, read_deps};
use super::manifest::{Manifest, ManifestEntry, Staleness, staleness};
use super::nvcc::{CompileCtx, Job, compile_all, flags};
use crate::error::{CompileFailure, Error, Result};
use crate::toolchain::{Nvshmem, Toolchain, ToolchainEnv};

/// Options of `build-kernels`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuildOptions {
    /// Only verify; build nothing, install nothing.
    pub check: bool,
    /// Rebuild everything.
    pub force: bool,
    /// Print the toolchain, every command and nvcc's output.
    pub verbose: bool,
}

/// What a build did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildSummary {
    /// Artifacts compiled in this run.
    pub built: Vec<String>,
    /// Artifacts that were already up to date.
    pub up_to_date: Vec<String>,
    /// Artifacts removed because their source is gone.
    pub removed: Vec<String>,
}

/// One planned artifact with its inputs resolved.
#[derive(Debug)]
struct Plan {
    src: KernelSource,
    entry: ManifestEntry,
    state: Staleness,
}

/// Runs `build-kernels` (or `--check`) for `paths`.
///
/// With `check`, builds, installs and writes nothing: fails with [`Error::StaleKernels`] when
/// any image is stale. Otherwise compiles every stale image (every image with `force`),
/// removes the artifacts whose image is no longer listed and saves the record; an image that
/// fails to compile loses its record entry and makes the whole run fail with
/// [`Error::KernelsFailed`] after the others are built.
pub fn build(paths: &Paths, env: &ToolchainEnv, opts: BuildOptions) -> Result<BuildSummary> {
    let sources = read_images(&paths.workspace)?;
    let mut manifest = Manifest::load(&paths.out_dir);
    if sources.is_empty() {
        println!(
            "build-kernels: no kernel images listed in {}; nothing to do",
            paths.workspace.join(IMAGES_FILE).display()
        );
        if opts.check {
            return Ok(BuildSummary::default());
        }
        fs::create_dir_all(&paths.out_dir).map_err(Error::io("creating", &paths.out_dir))?;
        let removed = remove_orphans(paths, &mut manifest, &BTreeSet::new())?;
        manifest.save(&paths.out_dir)?;
        return Ok(BuildSummary {
            removed,
            ..BuildSummary::default()
        });
    }
    let tc = Toolchain::resolve(env, !opts.check)?;
    if opts.verbose {
        println!(
            "build-kernels: nvcc {} ({}) from {}",
            tc.nvcc.display(),
            tc.version.text,
            tc.origin
        );
    }
    // One NVSHMEM install per release the images name.
    let mut nvshmem = BTreeMap::new();
    for release in sources.iter().filter_map(|s| s.nvshmem_release.as_deref()) {
        if !nvshmem.contains_key(release) {
            let found = Nvshmem::resolve_release(env, release, !opts.check)?;
            nvshmem.insert(release.to_string(), found);
        }
    }
    let plans = plan(paths, &sources, &manifest, &tc, &nvshmem)?;

    let wanted: BTreeSet<String> = plans.iter().map(|p| p.src.artifact.clone()).collect();
    if opts.check {
        return check(paths, &manifest, &plans, &wanted);
    }

    fs::create_dir_all(&paths.out_dir).map_err(Error::io("creating", &paths.out_dir))?;
    let mut summary = BuildSummary {
        removed: remove_orphans(paths, &mut manifest, &wanted)?,
        ..BuildSummary::default()
    };

    let (todo, done): (Vec<Plan>, Vec<Plan>) = plans
        .into_iter()
        .partition(|p| opts.force || p.state != Staleness::UpToDate);
    summary.up_to_date = done.iter().map(|p| p.src.artifact.clone()).collect();
    let results = compile(paths, env, &tc, opts.verbose, &todo)?;

    let mut failures = Vec::new();
    for (plan, result) in todo.into_iter().zip(results) {
        let artifact = plan.src.artifact.clone();
        match result {
            Ok(size) => {
                manifest
                    .artifacts
                    .insert(artifact.clone(), ManifestEntry { size, ..plan.entry });
                summary.built.push(artifact);
            }
            Err(failure) => {
                manifest.artifacts.remove(&artifact);
                failures.push(failure);
            }
        }
    }
    manifest.save(&paths.out_dir)?;
    println!(
        "build-kernels: {} built, {} up to date{} -> {}",
        summary.built.len(),
        summary.up_to_date.len(),
        if failures.is_empty() {
            String::new()
        } else {
            format!(", {} FAILED", failures.len())
        },
        paths.out_dir.display()
    );
    if failures.is_empty() {
        Ok(summary)
    } else {
        Err(Error::KernelsFailed { failures })
    }
}

/// Resolves every image's flags and inputs hash and compares it with the record; the plans
/// keep the image manifest's order, and each carries the record entry it gets once built
/// (size still 0).
fn plan(
    paths: &Paths,
    sources: &[KernelSource],
    manifest: &Manifest,
    tc: &Toolchain,
    nvshmem: &BTreeMap<String, Nvshmem>,
) -> Result<Vec<Plan>> {
    let deps = read_deps(&paths.workspace, &paths.kernels_dir())?;
    let mut plans = Vec::new();
    for src in sources {
        let source_bytes = fs::read(paths.workspace.join(&src.rel))
            .map_err(Error::io("reading", &paths.workspace.join(&src.rel)))?;
        let nvshmem = src.nvshmem_release.as_deref().and_then(|r| nvshmem.get(r));
        let (nvcc_flags, link_flags) = flags(src.kind, &paths.workspace, tc, nvshmem);
        let hash = inputs_hash(&HashInputs {
            kind: src.kind,
            source_rel: &src.rel,
            source: &source_bytes,
            deps: &deps,
            nvcc_flags: &nvcc_flags,
            link_flags: &link_flags,
            toolchain: &tc.version.text,
            nvshmem_lib: match src.kind {
                KernelKind::Fatbin => None,
                KernelKind::NvshmemCubin => nvshmem.map(|n| n.device_lib_sha256.as_str()),
            },
        });
        let state = staleness(
            manifest.artifacts.get(&src.artifact),
            &paths.out_dir.join(&src.artifact),
            &hash,
        );
        plans.push(Plan {
            src: src.clone(),
            entry: ManifestEntry {
                source: src.rel.clone(),
                kind: src.kind,
                inputs_sha256: hash,
                flags: nvcc_flags,
                link_flags,
                toolchain: tc.version.text.clone(),
                size: 0,
            },
            state,
        });
    }
    Ok(plans)
}

/// `--check`: notes the recorded artifacts no image wants (the next build removes them) and
/// fails with every stale image, or reports all `plans` up to date.
fn check(
    paths: &Paths,
    manifest: &Manifest,
    plans: &[Plan],
    wanted: &BTreeSet<String>,
) -> Result<BuildSummary> {
    let orphans: Vec<&String> = manifest
        .artifacts
        .keys()
        .filter(|k| !wanted.contains(*k))
        .collect();
    let stale: Vec<String> = plans
        .iter()
        .filter(|p| p.state != Staleness::UpToDate)
        .map(|p| format!("{} ({}): {}", p.src.artifact, p.src.rel, p.state.describe()))
        .collect();
    if !orphans.is_empty() {
        println!(
            "build-kernels: note: manifest lists artifacts without a source (removed on the next build): {}",
            orphans
                .iter()
                .map(|o| o.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !stale.is_empty() {
        return Err(Error::StaleKernels { stale });
    }
    println!(
        "build-kernels: {} artifact(s) up to date in {}",
        plans.len(),
        paths.out_dir.display()
    );
    Ok(BuildSummary {
        up_to_date: plans.iter().map(|p| p.src.artifact.clone()).collect(),
        ..BuildSummary::default()
    })
}

/// Compiles `todo` (resolving nvlink first when an NVSHMEM image is among them); one result
/// per plan, in order. Fails as a whole only when nvlink is needed and cannot be found.
fn compile(
    paths: &Paths,
    env: &ToolchainEnv,
    tc: &Toolchain,
    verbose: bool,
    todo: &[Plan],
) -> Result<Vec<std::result::Result<u64, CompileFailure>>> {
    if todo.is_empty() {
        return Ok(Vec::new());
    }
    let nvlink = if todo.iter().any(|p| p.src.kind == KernelKind::NvshmemCubin) {
        Some(tc.nvlink(env.path.as_deref())?)
    } else {
        None
    };
    let ctx = CompileCtx {
        workspace: &paths.workspace,
        out_dir: &paths.out_dir,
        toolchain: tc,
        nvlink: nvlink.as_deref(),
        verbose,
    };
    let jobs: Vec<Job<'_>> = todo
        .iter()
        .map(|p| Job {
            src: &p.src,
            nvcc_flags: &p.entry.flags,
            link_flags: &p.entry.link_flags,
        })
        .collect();
    Ok(compile_all(&ctx, &jobs))
}

/// Deletes the artifacts the manifest lists but no source produces any more (only files the
/// manifest names, so nothing else in the output directory is touched); returns their names.
fn remove_orphans(
    paths: &Paths,
    manifest: &mut Manifest,
    wanted: &BTreeSet<String>,
) -> Result<Vec<String>> {
    let orphans: Vec<String> = manifest
        .artifacts
        .keys()
        .filter(|k| !wanted.contains(*k))
        .cloned()
        .collect();
    for orphan in &orphans {
        let path = paths.out_dir.join(orphan);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("removing stale artifact", &path)(e)),
        }
        manifest.artifacts.remove(orphan);
        println!("build-kernels: removed {orphan} (its source is gone)");
    }
    Ok(orphans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

    /// A temporary directory with a fake nvcc in `bin/` and a workspace in `ws/` whose
    /// artifacts go to `ws/<out>`. The fake nvcc answers `--version`, copies its input (the
    /// `.cu` argument) to the output after `-o`, fails on sources containing `#error`, and logs
    /// each call (see [`calls`]).
    #[cfg(unix)]
    fn fake_nvcc_workspace(tag: &str, out: &str) -> (TempDir, ToolchainEnv, Paths) {
        let t = TempDir::new(tag);
        t.write_script(
            "bin/nvcc",
            r#"if [ "$1" = --version ]; then echo 'Cuda compilation tools, release 13.0, V13.0.88'; exit 0; fi
out=""; prev=""; src=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  case "$a" in *.cu) src="$a";; esac
  prev="$a"
done
echo "$src" >> "$(dirname "$0")/calls.log"
if grep -q '#error' "$src"; then echo "$src(1): error: boom" >&2; exit 2; fi
cat "$src" > "$out""#,
        );
        let env = ToolchainEnv {
            cuda_home: None,
            nvshmem_home: None,
            path: Some(t.path().join("bin").into_os_string()),
            pip_root: t.path().join("ws/target/cuda-toolchain"),
            python: "false".into(),
        };
        let ws = t.path().join("ws");
        let paths = Paths {
            out_dir: ws.join(out),
            workspace: ws,
            pip_root: env.pip_root.clone(),
        };
        (t, env, paths)
    }

    /// The sources the fake nvcc compiled since the last call, sorted.
    #[cfg(unix)]
    fn calls(t: &TempDir) -> Vec<String> {
        let mut v: Vec<String> = fs::read_to_string(t.path().join("bin/calls.log"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect();
        v.sort();
        fs::remove_file(t.path().join("bin/calls.log")).ok();
        v
    }

    #[cfg(unix)]
    #[test]
    fn incremental_build_check_force_and_orphans_with_a_fake_nvcc() {
        let (t, env, paths) = fake_nvcc_workspace("incr", "target/kernels");
        let check = BuildOptions {
            check: true,
            ..BuildOptions::default()
        };
        // No kernels directory: nothing to do, not even nvcc needed.
        let s = build(&paths, &env, BuildOptions::default()).expect("empty");
        assert!(s.built.is_empty());

        t.write("ws/kernels/a.cu", "A");
        t.write("ws/kernels/b.cu", "B");
        t.write("ws/kernels/common/common.cuh", "H1");
        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "a a.fatbin fatbin kernels/a.cu\nb b.fatbin fatbin kernels/b.cu\n",
        );
        let err = build(&paths, &env, check).expect_err("nothing built yet");
        assert!(
            matches!(&err, Error::StaleKernels { stale } if stale.len() == 2),
            "{err}"
        );

        let s = build(&paths, &env, BuildOptions::default()).expect("first build");
        assert_eq!(s.built, ["a.fatbin", "b.fatbin"]);
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);
        assert_eq!(
            fs::read_to_string(paths.out_dir.join("a.fatbin")).expect("a"),
            "A"
        );
        build(&paths, &env, check).expect("fresh after build");
        let m = Manifest::load(&paths.out_dir);
        assert_eq!(m.artifacts["b.fatbin"].size, 1);
        assert_eq!(m.artifacts["b.fatbin"].source, "kernels/b.cu");

        let s = build(&paths, &env, BuildOptions::default()).expect("no-op");
        assert!(s.built.is_empty() && s.up_to_date.len() == 2, "{s:?}");
        assert!(calls(&t).is_empty());

        t.write("ws/kernels/b.cu", "B2");
        let err = build(&paths, &env, check).expect_err("b changed");
        assert!(
            err.to_string()
                .contains("b.fatbin (kernels/b.cu): inputs changed"),
            "{err}"
        );
        build(&paths, &env, BuildOptions::default()).expect("rebuild b");
        assert_eq!(calls(&t), ["kernels/b.cu"]);

        t.write("ws/kernels/common/common.cuh", "H2");
        build(&paths, &env, BuildOptions::default()).expect("header change");
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);

        fs::remove_file(paths.out_dir.join("a.fatbin")).expect("rm");
        build(&paths, &env, BuildOptions::default()).expect("missing output");
        assert_eq!(calls(&t), ["kernels/a.cu"]);

        let force = BuildOptions {
            force: true,
            ..BuildOptions::default()
        };
        build(&paths, &env, force).expect("force");
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);

        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "a a.fatbin fatbin kernels/a.cu\n",
        );
        let s = build(&paths, &env, BuildOptions::default()).expect("orphan");
        assert_eq!(s.removed, ["b.fatbin"]);
        assert!(!paths.out_dir.join("b.fatbin").exists());
        assert!(
            !Manifest::load(&paths.out_dir)
                .artifacts
                .contains_key("b.fatbin")
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_kernel_reports_stderr_and_keeps_the_others() {
        let (t, env, paths) = fake_nvcc_workspace("fail", "out");
        t.write("ws/kernels/good.cu", "ok");
        t.write("ws/kernels/bad.cu", "#error nope");
        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "good good.fatbin fatbin kernels/good.cu\nbad bad.fatbin fatbin kernels/bad.cu\n",
        );
        let err = build(&paths, &env, BuildOptions::default()).expect_err("bad fails");
        let msg = err.to_string();
        assert!(msg.contains("--- kernels/bad.cu ---"), "{msg}");
        assert!(msg.contains("kernels/bad.cu(1): error: boom"), "{msg}");
        let m = Manifest::load(&paths.out_dir);
        assert!(m.artifacts.contains_key("good.fatbin"));
        assert!(!m.artifacts.contains_key("bad.fatbin"));
        assert!(!paths.out_dir.join("bad.fatbin").exists());
        let leftovers: Vec<_> = fs::read_dir(&paths.out_dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    /// The real thing: compiles a tiny kernel (and an NVSHMEM one) with the workspace's nvcc
    /// when one can be found without installing; otherwise says why it skipped.
    #[test]
    fn compiles_tiny_kernels_with_real_nvcc_when_available() {
        let real = Paths::from_env();
        let env = ToolchainEnv::from_process(real.pip_root.clone());
        if let Err(searched) = crate::toolchain::locate_nvcc(&env) {
            eprintln!("skipping: no nvcc available (searched: {searched:?})");
            return;
        }
        let t = TempDir::new("real");
        let ws = t.path().to_path_buf();
        let paths = Paths {
            workspace: ws.clone(),
            out_dir: ws.join("target/kernels"),
            pip_root: real.pip_root.clone(),
        };
        t.write(
            "kernels/common/tiny.cuh",
            "#pragma once\n#define TINY_ADD 1.0f\n",
        );
        t.write(
            "kernels/tiny/tiny.cu",
            "#include \"common/tiny.cuh\"\nextern \"C\" __global__ void tiny(float* x, int n) {\n\
             int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += TINY_ADD; }\n",
        );
        let with_nvshmem = crate::toolchain::locate_nvshmem_release(&env, "3.4.5").is_ok();
        let mut images = "tiny tiny.fatbin fatbin kernels/tiny/tiny.cu\n".to_string();
        if with_nvshmem {
            images.push_str("tiny_put tiny_put.cubin nvshmem_cubin kernels/tiny/put.cu 3.4.5\n");
            t.write(
                "kernels/tiny/put.cu",
                "#include <nvshmem.h>\n#include <nvshmemx.h>\n\
                 extern \"C\" __global__ void tiny_put(int* sig, int pe) { nvshmem_int_p(sig, 1, pe); nvshmem_quiet(); }\n",
            );
        } else {
            eprintln!("note: NVSHMEM not found; compiling the fatbin only");
        }
        t.write(IMAGES_FILE, &images);
        let s = build(&paths, &env, BuildOptions::default()).expect("real nvcc build");
        assert_eq!(s.built.len(), if with_nvshmem { 2 } else { 1 });
        let fatbin = fs::read(paths.out_dir.join("tiny.fatbin")).expect("fatbin");
        // Fatbin files start with the fatbin magic 0xBA55ED50 (little-endian).
        assert_eq!(&fatbin[..4], &[0x50, 0xed, 0x55, 0xba]);
        if with_nvshmem {
            let cubin = fs::read(paths.out_dir.join("tiny_put.cubin")).expect("cubin");
            assert_eq!(&cubin[..4], b"\x7fELF");
        }
        build(
            &paths,
            &env,
            BuildOptions {
                check: true,
                ..BuildOptions::default()
            },
        )
        .expect("up to date");
    }
}
