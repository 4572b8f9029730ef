//! `cargo xtask pack-device`: everything the GPU machine needs, in one folder.
//!
//! The folder holds the release `epcomm` binary, every test executable of the chosen packages
//! ([`DEFAULT_PACKAGES`] plus the `-p` ones, stripped of debug info), the kernel artifacts under
//! `kernels/`, and `run-gpu-tests.sh`, which runs all the test executables with the GPU tests
//! enabled, logs to one folder, and fails when no GPU test recorded a run.
//!
//! The packed executables embed no kernels: they are built in a target dir of their own
//! ([`BUILD_DIR`]) with `EPCOMM_KERNEL_DIR` naming an empty folder, so they load the images
//! from `$EPCOMM_KERNEL_DIR` at run time, which the runner points at the pack's `kernels/`.
//! Another build's kernels are then just another folder, chosen when a run starts (an A/B of
//! two kernel builds in one session on the GPU machine, with the same executables), and each
//! executable is a few MiB instead of carrying every image.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::kernels::{self, BuildOptions, Paths};
use crate::toolchain::ToolchainEnv;
use crate::util::{self, command_line, human_size};

/// The most a pack may hold: it is copied to the GPU machine on every run, so it stays small
/// (stripped release executables, one per test target, are about 9 MiB each).
pub const PACK_LIMIT_BYTES: u64 = 128 * 1024 * 1024;
/// Where the pack's executables are built (workspace-relative): a target dir of their own,
/// so that building them without embedded kernels leaves the workspace's builds as they are.
pub const BUILD_DIR: &str = "target/device-build";
/// The empty folder (inside [`BUILD_DIR`]) that `EPCOMM_KERNEL_DIR` names while the pack's
/// executables build: the kernels crate then embeds nothing and reads its images at run time.
pub const NO_KERNELS_DIR: &str = "no-kernels";

/// File that marks a folder as made by pack-device (so it may be cleared on the next pack).
pub const MARKER: &str = ".epcomm-device-pack";
/// Name of the generated runner script.
pub const SCRIPT: &str = "run-gpu-tests.sh";
/// The runner's full log, in its log folder.
pub const LOG_NAME: &str = "gpu-tests.log";
/// The runner's one-line-per-executable summary, in its log folder.
pub const SUMMARY_NAME: &str = "summary.txt";
/// The record of GPU test runs, in the runner's log folder: every GPU test that really ran on
/// GPUs appends one `<test name> <configuration>` line. The runner fails when it stays empty.
pub const RAN_NAME: &str = "gpu-tests-ran.txt";
/// The variable through which the runner tells the tests where [`RAN_NAME`] is.
pub const RAN_ENV: &str = "EPCOMM_GPU_TESTS_RAN_FILE";
/// Packages whose test executables are always packed: `epcomm`, and `epcomm-check`, whose
/// `tests/gpu.rs` (packed as `gpu-test`) holds the GPU tests.
pub const DEFAULT_PACKAGES: &[&str] = &["epcomm", "epcomm-check"];

/// Options of `pack-device`.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Output folder.
    pub out: PathBuf,
    /// Packages whose test executables are packed ([`DEFAULT_PACKAGES`] first, then the `-p`
    /// ones; see [`package_list`]).
    pub packages: Vec<String>,
    /// Print more.
    pub verbose: bool,
}

/// [`DEFAULT_PACKAGES`] followed by `extra`, in order, each package once.
pub fn package_list(extra: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut all: Vec<String> = DEFAULT_PACKAGES.iter().map(|p| p.to_string()).collect();
    for p in extra {
        if !all.contains(&p) {
            all.push(p);
        }
    }
    all
}

/// A compiled artifact reported by cargo's JSON messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CargoExecutable {
    /// Package name (from `package_id`).
    pub package: String,
    /// Target name, e.g. `epcomm` for a lib or `dispatch` for `tests/dispatch.rs`.
    pub target: String,
    /// First target kind: `lib`, `bin`, `test`, `bench`, ...
    pub kind: String,
    /// Whether it was built with the test harness.
    pub test: bool,
    /// Path of the executable.
    pub executable: PathBuf,
}

/// The package name in a cargo `package_id`, in either the new
/// (`path+file:///w/crates/epcomm#0.1.0`, `registry+…#name@1.0`) or the old
/// (`name 0.1.0 (path+file:///…)`) format.
pub fn package_name(package_id: &str) -> String {
    if let Some((url, frag)) = package_id.rsplit_once('#') {
        return match frag.split_once('@') {
            Some((name, _)) => name.to_string(),
            None => url
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or(url)
                .to_string(),
        };
    }
    package_id
        .split_whitespace()
        .next()
        .unwrap_or(package_id)
        .to_string()
}

/// Extracts every `compiler-artifact` with an `executable` from cargo's JSON output.
/// Lines that are not JSON objects (cargo never prints those on stdout) are an error.
pub fn parse_executables(stdout: &str) -> Result<Vec<CargoExecutable>> {
    let mut out = Vec::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let msg: Value = serde_json::from_str(line).map_err(|source| Error::CargoJson {
            line: line.chars().take(200).collect(),
            source,
        })?;
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(executable) = msg["executable"].as_str() else {
            continue;
        };
        out.push(CargoExecutable {
            package: package_name(msg["package_id"].as_str().unwrap_or("")),
            target: msg["target"]["name"].as_str().unwrap_or("").to_string(),
            kind: msg["target"]["kind"][0].as_str().unwrap_or("").to_string(),
            test: msg["profile"]["test"].as_bool().unwrap_or(false),
            executable: PathBuf::from(executable),
        });
    }
    Ok(out)
}

/// File names for packed test executables: `<target>-test`, or `<package>-<target>-test`, or
/// `<package>-<target>-<kind>-test` when a shorter name is already taken. Sorted first, so the
/// names do not depend on the order cargo finished building in.
pub fn test_names(mut tests: Vec<CargoExecutable>) -> Vec<(String, CargoExecutable)> {
    tests.sort_by(|a, b| (&a.package, &a.kind, &a.target).cmp(&(&b.package, &b.kind, &b.target)));
    tests.dedup_by(|a, b| a.executable == b.executable);
    let mut taken = BTreeSet::new();
    let mut out = Vec::new();
    for t in tests {
        let candidates = [
            format!("{}-test", t.target),
            format!("{}-{}-test", t.package, t.target),
            format!("{}-{}-{}-test", t.package, t.target, t.kind),
        ];
        let name = candidates
            .iter()
            .find(|c| !taken.contains(*c))
            .cloned()
            .unwrap_or_else(|| format!("{}-{}-{}-{}-test", t.package, t.target, t.kind, out.len()));
        taken.insert(name.clone());
        out.push((name, t));
    }
    out
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs a cargo command with `--message-format=json-render-diagnostics` (diagnostics go to
/// the terminal) and returns the executables it reported.
fn cargo_executables(workspace: &Path, args: &[&str]) -> Result<Vec<CargoExecutable>> {
    let build_dir = workspace.join(BUILD_DIR);
    let no_kernels = build_dir.join(NO_KERNELS_DIR);
    fs::create_dir_all(&no_kernels).map_err(Error::io("creating", &no_kernels))?;
    let mut cmd = cargo();
    cmd.current_dir(workspace)
        .env("CARGO_TARGET_DIR", &build_dir)
        .env("EPCOMM_KERNEL_DIR", &no_kernels)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit());
    let line = command_line(&cmd);
    println!("pack-device: $ {line}");
    let out = cmd.output().map_err(|source| Error::Spawn {
        command: line.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(Error::CommandFailed {
            command: line,
            status: out.status.to_string(),
            output: "(cargo's diagnostics are above)".to_string(),
        });
    }
    parse_executables(&String::from_utf8_lossy(&out.stdout))
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).map_err(Error::io("copying into the pack", to))?;
    Ok(())
}

/// Strips debug info from `file` with `strip --strip-debug` (symbols stay, so panics still
/// name functions). Warns and keeps the file as is when strip is missing or fails.
fn strip(file: &Path) {
    let mut cmd = Command::new("strip");
    cmd.arg("--strip-debug").arg(file);
    if let Err(e) = util::run_captured(&mut cmd) {
        eprintln!("pack-device: warning: not stripped ({e})");
    }
}

/// Empties `out` if it is new, empty or an earlier pack; refuses any other folder.
fn prepare_out(out: &Path) -> Result<()> {
    match fs::read_dir(out) {
        Ok(mut entries) => {
            if entries.next().is_some() && !out.join(MARKER).is_file() {
                return Err(Error::OutNotAPack {
                    out: out.to_path_buf(),
                    marker: MARKER,
                });
            }
            fs::remove_dir_all(out).map_err(Error::io("clearing", out))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("listing", out)(e)),
    }
    fs::create_dir_all(out.join("kernels")).map_err(Error::io("creating", out))?;
    fs::write(
        out.join(MARKER),
        "made by `cargo xtask pack-device`; cleared by the next pack\n",
    )
    .map_err(Error::io("writing", &out.join(MARKER)))
}

/// Sum of file sizes under `dir` (recursively) and the files, largest first.
fn folder_size(dir: &Path) -> Result<(u64, Vec<(String, u64)>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).map_err(Error::io("listing", &d))? {
            let entry = entry.map_err(Error::io("listing", &d))?;
            let meta = entry
                .metadata()
                .map_err(Error::io("reading", &entry.path()))?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                files.push((util::relative_to(dir, &entry.path()), meta.len()));
            }
        }
    }
    files.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok((files.iter().map(|f| f.1).sum(), files))
}

/// Fails with [`Error::PackTooLarge`] when the files under `out` reach `limit` bytes.
pub fn check_size(out: &Path, limit: u64) -> Result<u64> {
    let (total, files) = folder_size(out)?;
    if total >= limit {
        return Err(Error::PackTooLarge {
            out: out.to_path_buf(),
            total,
            limit,
            largest: files
                .iter()
                .take(8)
                .map(|(n, s)| format!("{n}: {}", human_size(*s)))
                .collect(),
        });
    }
    Ok(total)
}

/// The runner script for the given test executable names.
pub fn runner_script(tests: &[String]) -> String {
    let list = tests.iter().map(|t| format!("  {t}\n")).collect::<String>();
    format!(
        r#"#!/usr/bin/env bash
# Generated by `cargo xtask pack-device`; regenerate rather than edit.
# Usage (from the repository root on the GPU machine):
#   bash target/device/{SCRIPT} [LOGDIR] [TEST-BINARY-ARGS...]
# LOGDIR defaults to $EPCOMM_TEST_LOGDIR when set, else <this folder>/logs; it receives three files:
# {LOG_NAME} (everything, as printed), {SUMMARY_NAME} (one line per test executable, then the
# number of GPU test runs) and {RAN_NAME} (one line per GPU test run: every GPU test that
# really ran on GPUs appends `<test name> <configuration>` to ${RAN_ENV}).
# Extra arguments (e.g. a test-name filter) go to every test executable. Each executable runs
# with --test-threads=1 (the GPU tests spawn their own one-process-per-GPU workers) under a
# time limit of EPCOMM_TEST_TIMEOUT seconds (default 540). Exits nonzero when any failed or
# timed out, and when no GPU test recorded a run (even if every executable exited 0).
set -uo pipefail

here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
logdir="${{1:-${{EPCOMM_TEST_LOGDIR:-$here/logs}}}}"
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$logdir"
logdir="$(cd "$logdir" && pwd)"
log="$logdir/{LOG_NAME}"
summary="$logdir/{SUMMARY_NAME}"
ran_file="$logdir/{RAN_NAME}"
: > "$log"
: > "$summary"
: > "$ran_file"

# NVLink multicast can take the whole host down: keep it off for NVSHMEM and NCCL.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
export EPCOMM_GPU_TESTS=1
export {RAN_ENV}="$ran_file"
export EPCOMM_KERNEL_DIR="$here/kernels"
export EPCOMM_BIN="$here/epcomm"
export PATH="$here:$PATH"
export RUST_BACKTRACE="${{RUST_BACKTRACE:-1}}"
timeout_s="${{EPCOMM_TEST_TIMEOUT:-540}}"

tests=(
{list})

{{
  echo "== GPUs (nvidia-smi -L)"
  nvidia-smi -L 2>&1 || echo "warning: nvidia-smi -L failed"
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
  if [ "${{gpus:-0}}" -eq 1 ] && [ -z "${{EPCOMM_TEST_WORLD:-}}" ]; then
    echo "note: one GPU and EPCOMM_TEST_WORLD unset: the multi-rank GPU tests need two ranks" \
      "and fail saying so; run with EPCOMM_TEST_WORLD=2 (two ranks share the GPU; under MPS," \
      "\`nvidia-cuda-mps-control -d\`, they run at the same time)"
  fi
  echo "== logs in $logdir"
}} 2>&1 | tee -a "$log"

failed=0
for t in "${{tests[@]}}"; do
  echo "== $t --test-threads=1 $*" | tee -a "$log"
  start=$SECONDS
  timeout --kill-after=30 "$timeout_s" "$here/$t" --test-threads=1 "$@" 2>&1 | tee -a "$log"
  rc=${{PIPESTATUS[0]}}
  secs=$(( SECONDS - start ))
  if [ "$rc" -eq 0 ]; then
    status=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMEOUT after ${{timeout_s}}s"; failed=$(( failed + 1 ))
  else
    status="FAILED (exit $rc)"; failed=$(( failed + 1 ))
  fi
  printf '%-40s %-24s %5ds\n' "$t" "$status" "$secs" >> "$summary"
done

# Every GPU test that really ran appended one line; a run in which none did proves nothing.
ran="$(grep -c '[^[:space:]]' "$ran_file" 2>/dev/null)"
ran="${{ran:-0}}"
echo "GPU test runs recorded: $ran (listed in {RAN_NAME})" >> "$summary"
[ "$ran" -gt 0 ] || echo "FAILED: no GPU test ran" >> "$summary"

{{
  echo "== summary (${{#tests[@]}} test executables, $failed failed)"
  cat "$summary"
  [ "${{#tests[@]}}" -gt 0 ] || echo "note: no test executables were packed"
  echo "== GPU test runs recorded in $ran_file: $ran"
  grep '[^[:space:]]' "$ran_file" 2>/dev/null | sed 's/^/  /'
  if [ "$ran" -eq 0 ]; then
    echo "error: no GPU test ran: ${{#tests[@]}} test executable(s) ran with EPCOMM_GPU_TESTS=1," \
      "but none recorded a GPU test run in $ran_file; was gpu-test packed," \
      "and does the filter select any GPU test?"
  fi
}} 2>&1 | tee -a "$log"
[ "$failed" -eq 0 ] && [ "$ran" -gt 0 ]
"#
    )
}

/// What goes into the pack's `kernels/`: the artifact of every image of the image manifest,
/// then the build record (`manifest.json`), all of which `build-kernels` has just written.
pub fn kernel_files(workspace: &Path) -> Result<Vec<String>> {
    let mut files: Vec<String> = kernels::read_images(workspace)?
        .into_iter()
        .map(|image| image.artifact)
        .collect();
    files.push(kernels::MANIFEST_NAME.to_string());
    Ok(files)
}

/// Runs `pack-device`.
pub fn pack(paths: &Paths, env: &ToolchainEnv, opts: &PackOptions) -> Result<()> {
    kernels::build(
        paths,
        env,
        BuildOptions {
            verbose: opts.verbose,
            ..BuildOptions::default()
        },
    )?;

    let cli = cargo_executables(
        &paths.workspace,
        &["build", "--release", "-p", "epcomm-cli"],
    )?;
    let cli: Vec<_> = cli
        .into_iter()
        .filter(|e| e.kind == "bin" && !e.test)
        .collect();
    if cli.is_empty() {
        return Err(Error::NoCliBinary {
            command: "cargo build --release -p epcomm-cli".to_string(),
        });
    }

    let mut args = vec!["test", "--release", "--no-run"];
    for p in &opts.packages {
        args.extend(["-p", p.as_str()]);
    }
    let tests: Vec<_> = cargo_executables(&paths.workspace, &args)?
        .into_iter()
        .filter(|e| e.test)
        .collect();
    for p in &opts.packages {
        if !tests.iter().any(|t| &t.package == p) {
            println!("pack-device: package {p} has no test executables; skipped");
        }
    }

    let out = &opts.out;
    prepare_out(out)?;
    for bin in &cli {
        let Some(name) = bin.executable.file_name() else {
            continue;
        };
        let dest = out.join(name);
        copy_file(&bin.executable, &dest)?;
        strip(&dest);
    }
    let named = test_names(tests);
    for (name, t) in &named {
        let dest = out.join(name);
        copy_file(&t.executable, &dest)?;
        strip(&dest);
        if opts.verbose {
            println!("pack-device: {} -> {name}", t.executable.display());
        }
    }
    for name in kernel_files(&paths.workspace)? {
        copy_file(&paths.out_dir.join(&name), &out.join("kernels").join(&name))?;
    }
    let names: Vec<String> = named.into_iter().map(|(n, _)| n).collect();
    let script = out.join(SCRIPT);
    fs::write(&script, runner_script(&names)).map_err(Error::io("writing", &script))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755))
            .map_err(Error::io("making executable", &script))?;
    }

    let total = check_size(out, PACK_LIMIT_BYTES)?;
    println!(
        "pack-device: {} ({} test executable(s): {}) -> {}",
        human_size(total),
        names.len(),
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        },
        out.display()
    );
    println!(
        "pack-device: on the GPU machine, from the repository root: bash {}/{SCRIPT} [LOGDIR]",
        util::relative_to(&paths.workspace, out)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

    const CARGO_OUTPUT: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/epcomm#0.1.0","manifest_path":"/w/crates/epcomm/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"epcomm","src_path":"/w/crates/epcomm/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"profile":{"opt_level":"3","debuginfo":1,"debug_assertions":false,"overflow_checks":false,"test":true},"features":[],"filenames":["/w/target/release/deps/epcomm-1234"],"executable":"/w/target/release/deps/epcomm-1234","fresh":false}
{"reason":"compiler-artifact","package_id":"path+file:///w/crates/epcomm#0.1.0","target":{"kind":["lib"],"name":"epcomm"},"profile":{"test":false},"filenames":["/w/target/release/deps/libepcomm-1.rlib"],"executable":null,"fresh":true}
{"reason":"compiler-artifact","package_id":"path+file:///w/crates/epcomm-cli#0.1.0","target":{"kind":["bin"],"name":"epcomm"},"profile":{"test":true},"executable":"/w/target/release/deps/epcomm-99","fresh":false}
{"reason":"compiler-artifact","package_id":"registry+https://github.com/rust-lang/crates.io-index#half@2.7.1","target":{"kind":["lib"],"name":"half"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","package_id":"epcomm 0.1.0 (path+file:///w/crates/epcomm)","target":{"kind":["test"],"name":"gpu_dispatch"},"profile":{"test":true},"executable":"/w/target/release/deps/gpu_dispatch-5"}
{"reason":"build-finished","success":true}
"#;

    #[test]
    fn parses_test_executables_from_cargo_json() {
        let all = parse_executables(CARGO_OUTPUT).expect("parse");
        assert_eq!(all.len(), 3, "{all:?}");
        assert!(all.iter().all(|e| e.test));
        assert_eq!(all[0].package, "epcomm");
        assert_eq!(all[0].kind, "lib");
        assert_eq!(all[1].package, "epcomm-cli");
        assert_eq!(all[2].package, "epcomm");
        assert_eq!(all[2].target, "gpu_dispatch");
        assert_eq!(
            all[2].executable,
            PathBuf::from("/w/target/release/deps/gpu_dispatch-5")
        );
        let err = parse_executables("warning: not json\n").expect_err("non-json");
        assert!(err.to_string().contains("warning: not json"), "{err}");
    }

    #[test]
    fn package_names_from_both_id_formats() {
        assert_eq!(
            package_name("path+file:///w/crates/epcomm-cli#0.1.0"),
            "epcomm-cli"
        );
        assert_eq!(
            package_name("path+file:///w/crates/dir#my-pkg@0.1.0"),
            "my-pkg"
        );
        assert_eq!(
            package_name("registry+https://github.com/rust-lang/crates.io-index#half@2.7.1"),
            "half"
        );
        assert_eq!(
            package_name("epcomm 0.1.0 (path+file:///w/crates/epcomm)"),
            "epcomm"
        );
    }

    #[test]
    fn test_names_are_unique_and_readable() {
        let named = test_names(parse_executables(CARGO_OUTPUT).expect("parse"));
        let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        // epcomm (lib) and epcomm-cli's bin `epcomm` share a target name.
        assert_eq!(
            names,
            ["epcomm-test", "gpu_dispatch-test", "epcomm-cli-epcomm-test"]
        );
    }

    #[test]
    fn prepare_out_refuses_foreign_folders_and_clears_packs() {
        let t = TempDir::new("out");
        let foreign = t.path().join("foreign");
        t.write("foreign/important.txt", "keep me");
        let err = prepare_out(&foreign).expect_err("not a pack");
        assert!(matches!(err, Error::OutNotAPack { .. }), "{err}");
        assert!(foreign.join("important.txt").exists());

        let pack = t.path().join("pack");
        prepare_out(&pack).expect("new folder");
        t.write("pack/old-test", "stale");
        prepare_out(&pack).expect("earlier pack");
        assert!(!pack.join("old-test").exists());
        assert!(pack.join(MARKER).is_file() && pack.join("kernels").is_dir());
    }

    #[test]
    fn size_limit_is_enforced() {
        let t = TempDir::new("size");
        t.write("a", &"x".repeat(600));
        t.write("kernels/b.fatbin", &"y".repeat(500));
        assert_eq!(check_size(t.path(), 2000).expect("fits"), 1100);
        let err = check_size(t.path(), 1000).expect_err("too big");
        let msg = err.to_string();
        assert!(
            msg.contains("1100 bytes, over the 1000 byte limit"),
            "{msg}"
        );
        assert!(
            msg.contains("  - a: 600 B\n  - kernels/b.fatbin: 500 B"),
            "{msg}"
        );
    }

    #[test]
    fn packs_every_image_of_the_manifest_and_the_build_record() {
        let t = TempDir::new("kfiles");
        assert_eq!(
            kernel_files(t.path()).expect("no manifest"),
            ["manifest.json"]
        );
        t.write(
            kernels::IMAGES_FILE,
            "a a.fatbin fatbin kernels/a.cu\nb b.cubin nvshmem_cubin kernels/b.cu 3.4.5\n",
        );
        assert_eq!(
            kernel_files(t.path()).expect("manifest"),
            ["a.fatbin", "b.cubin", "manifest.json"]
        );
    }

    #[test]
    fn default_packages_include_the_gpu_tests_once_each() {
        assert_eq!(package_list(Vec::new()), ["epcomm", "epcomm-check"]);
        let extra = [
            "epcomm-transport",
            "epcomm-check",
            "epcomm",
            "epcomm-transport",
        ];
        assert_eq!(
            package_list(extra.map(String::from)),
            ["epcomm", "epcomm-check", "epcomm-transport"]
        );
    }

    #[test]
    fn runner_script_exports_the_ran_file_and_fails_on_zero_runs() {
        let s = runner_script(&["gpu-test".into(), "epcomm-test".into()]);
        assert!(s.contains("\n  gpu-test\n  epcomm-test\n)"), "{s}");
        assert!(
            s.contains("ran_file=\"$logdir/gpu-tests-ran.txt\"\n"),
            "{s}"
        );
        assert!(
            s.contains("\n: > \"$ran_file\"\n"),
            "truncated at start:\n{s}"
        );
        assert!(s.contains("\nexport EPCOMM_GPU_TESTS=1\n"), "{s}");
        let export = s
            .find("\nexport EPCOMM_GPU_TESTS_RAN_FILE=\"$ran_file\"\n")
            .expect("ran file exported");
        let run = s.find("\"$here/$t\" --test-threads=1").expect("runs tests");
        assert!(export < run, "exported before the tests run:\n{s}");
        assert!(s.contains("error: no GPU test ran: "), "{s}");
        assert!(
            s.ends_with("\n[ \"$failed\" -eq 0 ] && [ \"$ran\" -gt 0 ]\n"),
            "exit status needs no failure and at least one GPU test run:\n{s}"
        );
    }

    /// Runs `script` with bash, a fake `nvidia-smi` (one GPU) first on PATH, and `args`.
    #[cfg(unix)]
    fn run_runner(t: &TempDir, script: &Path, args: &[&std::ffi::OsStr]) -> (bool, String) {
        run_runner_env(t, script, args, None)
    }

    /// [`run_runner`] with `EPCOMM_TEST_WORLD` set to `world` (unset when `None`).
    #[cfg(unix)]
    fn run_runner_env(
        t: &TempDir,
        script: &Path,
        args: &[&std::ffi::OsStr],
        world: Option<&str>,
    ) -> (bool, String) {
        t.write_script("bin/nvidia-smi", "echo 'GPU 0: fake'");
        let path = format!(
            "{}:{}",
            t.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.arg(script)
            .args(args)
            .env("PATH", path)
            .env_remove("EPCOMM_TEST_LOGDIR")
            .env_remove(RAN_ENV)
            .env_remove("EPCOMM_TEST_WORLD");
        if let Some(w) = world {
            cmd.env("EPCOMM_TEST_WORLD", w);
        }
        let out = cmd.output().expect("run bash");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success(), stdout)
    }

    /// On one GPU without `EPCOMM_TEST_WORLD` the script says up front that two ranks are
    /// needed; with it set, it says nothing.
    #[cfg(unix)]
    #[test]
    fn runner_script_on_one_gpu_asks_for_two_ranks_up_front() {
        let t = TempDir::new("one-gpu");
        t.write_script(
            "pack/ok-test",
            r#"echo "ok_gpu ipc/epoch" >> "$EPCOMM_GPU_TESTS_RAN_FILE""#,
        );
        let script = t.write("pack/run.sh", &runner_script(&["ok-test".into()]));
        let logs = t.path().join("logs");
        let (ok, stdout) = run_runner_env(&t, &script, &[logs.as_os_str()], None);
        assert!(ok, "{stdout}");
        let note = stdout.find("EPCOMM_TEST_WORLD=2").expect("the note");
        let first_test = stdout.find("== ok-test").expect("the test ran");
        assert!(note < first_test, "said before any test:\n{stdout}");
        let (ok, stdout) = run_runner_env(&t, &script, &[logs.as_os_str()], Some("2"));
        assert!(ok, "{stdout}");
        assert!(!stdout.contains("EPCOMM_TEST_WORLD=2"), "{stdout}");
    }

    /// Runs the generated script with stand-in test executables: one passes (and records a
    /// GPU test run), one fails.
    #[cfg(unix)]
    #[test]
    fn runner_script_runs_everything_logs_and_fails_on_any_failure() {
        let t = TempDir::new("script");
        t.write_script(
            "pack/ok-test",
            r#"echo "ok args=$* gpu=$EPCOMM_GPU_TESTS nvls=$NVSHMEM_DISABLE_NVLS$NCCL_NVLS_ENABLE"
echo "ok_gpu ipc/epoch" >> "$EPCOMM_GPU_TESTS_RAN_FILE""#,
        );
        t.write_script("pack/bad-test", "echo failing; exit 101");
        let script = t.write(
            "pack/run.sh",
            &runner_script(&["ok-test".into(), "bad-test".into()]),
        );
        let logs = t.path().join("logs");
        let (ok, stdout) = run_runner(&t, &script, &[logs.as_os_str(), "my_filter".as_ref()]);
        assert!(!ok, "a failing test makes the script fail:\n{stdout}");
        assert!(stdout.contains("GPU 0: fake"), "{stdout}");
        let log = fs::read_to_string(logs.join(LOG_NAME)).expect("log");
        assert!(log.contains("GPU 0: fake"), "{log}");
        assert!(
            log.contains("\nok args=--test-threads=1 my_filter gpu=1 nvls=10\n"),
            "{log}"
        );
        assert!(log.contains("\nfailing\n"), "{log}");
        assert!(log.contains("1 failed"), "{log}");
        assert!(!log.contains("no GPU test ran"), "one GPU test ran:\n{log}");
        let mut files: Vec<String> = fs::read_dir(&logs)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [RAN_NAME, LOG_NAME, SUMMARY_NAME],
            "only the log, the summary and the record of GPU test runs"
        );
        let summary = fs::read_to_string(logs.join(SUMMARY_NAME)).expect("summary");
        assert!(
            summary.contains("ok-test") && summary.contains(" ok "),
            "{summary}"
        );
        assert!(summary.contains("FAILED (exit 101)"), "{summary}");
        assert!(summary.contains("GPU test runs recorded: 1 "), "{summary}");
        assert!(stdout.contains("2 test executables, 1 failed"), "{stdout}");

        let script = t.write("pack/run-ok.sh", &runner_script(&["ok-test".into()]));
        let out = Command::new("bash")
            .arg(&script)
            .env("EPCOMM_TEST_LOGDIR", t.path().join("out-env"))
            .output()
            .expect("run bash");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            t.path().join("out-env").join(LOG_NAME).is_file(),
            "LOGDIR defaults to $EPCOMM_TEST_LOGDIR"
        );
    }

    /// Every executable passes, but none records a GPU test run: the script fails. A stale
    /// record from an earlier run in the same folder does not count.
    #[cfg(unix)]
    #[test]
    fn runner_script_fails_when_no_gpu_test_ran() {
        let t = TempDir::new("zero");
        t.write_script(
            "pack/cpu-test",
            r#"echo "cpu only, ran-file=$EPCOMM_GPU_TESTS_RAN_FILE"; echo "SKIP gpu: no driver""#,
        );
        let logs = t.path().join("logs");
        t.write(
            &format!("logs/{RAN_NAME}"),
            "stale_test ipc/epoch\nstale_test nvshmem/global\n",
        );
        let script = t.write("pack/run.sh", &runner_script(&["cpu-test".into()]));
        let (ok, stdout) = run_runner(&t, &script, &[logs.as_os_str()]);
        assert!(!ok, "zero GPU test runs must fail the run:\n{stdout}");
        let ran_file = logs.join(RAN_NAME);
        assert!(
            stdout.contains(&format!("ran-file={}\n", ran_file.display())),
            "{stdout}"
        );
        assert!(stdout.contains("1 test executables, 0 failed"), "{stdout}");
        assert!(
            stdout.contains("error: no GPU test ran: 1 test executable(s) ran"),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!(
                "GPU test runs recorded in {}: 0\n",
                ran_file.display()
            )),
            "{stdout}"
        );
        assert!(!stdout.contains("stale_test"), "{stdout}");
        assert_eq!(fs::read_to_string(&ran_file).expect("ran file"), "");
        let summary = fs::read_to_string(logs.join(SUMMARY_NAME)).expect("summary");
        assert!(summary.contains("GPU test runs recorded: 0 "), "{summary}");
        assert!(summary.contains("FAILED: no GPU test ran"), "{summary}");
        let log = fs::read_to_string(logs.join(LOG_NAME)).expect("log");
        assert!(log.contains("error: no GPU test ran: "), "{log}");

        // Nothing packed at all: nothing ran either.
        let script = t.write("pack/run-none.sh", &runner_script(&[]));
        let (ok, stdout) = run_runner(&t, &script, &[logs.as_os_str()]);
        assert!(!ok, "{stdout}");
        assert!(
            stdout.contains("no test executables were packed"),
            "{stdout}"
        );
        assert!(
            stdout.contains("error: no GPU test ran: 0 test"),
            "{stdout}"
        );
    }

    /// The same CPU-only executable next to one that records two GPU test runs: the script
    /// passes and lists the runs.
    #[cfg(unix)]
    #[test]
    fn runner_script_passes_and_lists_recorded_gpu_test_runs() {
        let t = TempDir::new("nonzero");
        t.write_script("pack/cpu-test", "echo cpu only");
        t.write_script(
            "pack/gpu-test",
            r#"echo "suite ipc/epoch" >> "$EPCOMM_GPU_TESTS_RAN_FILE"
echo "suite nvshmem/global" >> "$EPCOMM_GPU_TESTS_RAN_FILE""#,
        );
        let logs = t.path().join("logs");
        t.write(&format!("logs/{RAN_NAME}"), "stale_test ipc/epoch\n");
        let script = t.write(
            "pack/run.sh",
            &runner_script(&["cpu-test".into(), "gpu-test".into()]),
        );
        let (ok, stdout) = run_runner(&t, &script, &[logs.as_os_str()]);
        assert!(ok, "two GPU test runs, no failure:\n{stdout}");
        let ran_file = logs.join(RAN_NAME);
        assert!(
            stdout.contains(&format!(
                "GPU test runs recorded in {}: 2\n  suite ipc/epoch\n  suite nvshmem/global\n",
                ran_file.display()
            )),
            "{stdout}"
        );
        assert!(!stdout.contains("no GPU test ran"), "{stdout}");
        assert!(!stdout.contains("stale_test"), "{stdout}");
        assert_eq!(
            fs::read_to_string(&ran_file).expect("ran file"),
            "suite ipc/epoch\nsuite nvshmem/global\n"
        );
        let summary = fs::read_to_string(logs.join(SUMMARY_NAME)).expect("summary");
        assert!(summary.contains("GPU test runs recorded: 2 "), "{summary}");
        assert!(!summary.contains("FAILED"), "{summary}");
    }
}
