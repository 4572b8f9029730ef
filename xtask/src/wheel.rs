//! `cargo xtask wheel`: builds the Python package (`python/`, native module `crates/epcomm-py`)
//! into one wheel in `target/wheels` with the kernels inside, checks it, and optionally runs the
//! CPU-side pytest suite and installs it.
//!
//! Steps: `build-kernels` (the native module embeds `target/kernels` at compile time); a
//! virtual environment in `target/python-venv` with the pinned PyPI tools ([`TOOLS`]), made once
//! and reused; `maturin build --release` from `python/` (cargo's target directory is the
//! workspace's, so the crates build once for every command); then [`verify`]: the wheel holds
//! the package's Python files as they are in `python/`, the native module, and every kernel
//! artifact byte for byte; finally it must import in the venv.
//!
//! `--check` builds nothing: it verifies the wheel that is there and that no input changed
//! after it was built (exit 1 otherwise, like `build-kernels --check`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use crate::error::Error as XtaskError;
use crate::kernels::{self, BuildOptions, Paths};
use crate::toolchain::ToolchainEnv;
use crate::util::{self, command_line};

/// The PyPI tools the build and the tests use, pinned.
pub const TOOLS: [&str; 3] = ["maturin==1.16.0", "pytest==9.2.0", "pyflakes==4.1.0"];

/// The virtual environment of the tools, inside the workspace.
pub const VENV_DIR: &str = "target/python-venv";

/// Where the wheel goes.
pub const WHEEL_DIR: &str = "target/wheels";

/// Marker in the venv naming the tools installed there.
const TOOLS_STAMP: &str = "epcomm-tools.txt";

/// The package's distribution name (the wheel file name starts with it).
const DIST: &str = "epcomm";

/// Options of `cargo xtask wheel`.
#[derive(Debug, Clone, Copy, Default)]
pub struct WheelOptions {
    /// Verify the wheel that is there; build nothing.
    pub check: bool,
    /// Run the pytest suite of `python/tests` in the venv after the build.
    pub test: bool,
    /// `pip install` the wheel into `$PYTHON` (default `python3`) after the build.
    pub install: bool,
}

/// What can go wrong, beyond running programs and files.
#[derive(Debug, thiserror::Error)]
pub enum WheelError {
    /// Running a program, a file operation or the kernel build failed.
    #[error(transparent)]
    Xtask(#[from] XtaskError),
    /// No wheel (for `--check`) or several (after a build that should leave one).
    #[error(
        "expected one {DIST} wheel in {}, found {}{}; run `cargo xtask wheel`",
        dir.display(),
        found.len(),
        if found.is_empty() { String::new() } else { format!(" ({})", found.join(", ")) }
    )]
    WheelCount {
        /// The wheel directory.
        dir: PathBuf,
        /// The wheel files found.
        found: Vec<String>,
    },
    /// The wheel lacks something or holds an old copy of it.
    #[error("the wheel {} is incomplete or out of date:\n{}", wheel.display(), bullets(problems))]
    Invalid {
        /// The wheel.
        wheel: PathBuf,
        /// One line per problem.
        problems: Vec<String>,
    },
}

fn bullets(items: &[String]) -> String {
    items
        .iter()
        .map(|i| format!("  - {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `cargo xtask wheel` with `opts`; returns what to print.
pub fn run(paths: &Paths, env: &ToolchainEnv, opts: WheelOptions) -> Result<String, WheelError> {
    let ws = &paths.workspace;
    let wheel_dir = ws.join(WHEEL_DIR);
    if opts.check {
        let wheel = the_wheel(&wheel_dir)?;
        let unpacked = unpack(env, &wheel, &wheel_dir)?;
        let mut problems = verify(&unpacked, &ws.join("python"), &kernel_artifacts(paths)?)?;
        problems.extend(newer_inputs(&wheel, ws)?);
        return report(wheel, problems, "complete and up to date");
    }
    kernels::build(paths, env, BuildOptions::default())?;
    let venv = ensure_venv(env, &ws.join(VENV_DIR))?;
    remove_old_wheels(&wheel_dir)?;
    let mut maturin = Command::new(venv_bin(&venv, "maturin"));
    maturin
        .current_dir(ws.join("python"))
        .args(["build", "--release", "--out"])
        .arg(&wheel_dir)
        .env("EPCOMM_KERNEL_DIR", &paths.out_dir);
    println!("wheel: $ {}", command_line(&maturin));
    util::run_inherited(&mut maturin)?;
    let wheel = the_wheel(&wheel_dir)?;
    let unpacked = unpack(env, &wheel, &wheel_dir)?;
    let problems = verify(&unpacked, &ws.join("python"), &kernel_artifacts(paths)?)?;
    if !problems.is_empty() {
        return report(wheel, problems, "");
    }
    let venv_python = venv_bin(&venv, "python");
    pip_install(&venv_python, &wheel)?;
    let mut import = Command::new(&venv_python);
    import.current_dir(ws).args([
        "-c",
        "import epcomm, sys; print('wheel: import epcomm', epcomm.__version__, 'ok; kernels embedded:', \
         epcomm.kernels_embedded()); sys.exit(0 if epcomm.kernels_embedded() else 1)",
    ]);
    util::run_inherited(&mut import)?;
    if opts.test {
        // The console script, not `python -m pytest`: that would put python/ (the sources,
        // without the native module) first on sys.path instead of the installed wheel.
        let mut pytest = Command::new(venv_bin(&venv, "pytest"));
        pytest.current_dir(ws.join("python")).arg("tests");
        println!("wheel: $ {}", command_line(&pytest));
        util::run_inherited(&mut pytest)?;
    }
    if opts.install {
        pip_install(Path::new(&env.python), &wheel)?;
    }
    report(wheel, Vec::new(), "built and verified")
}

fn report(wheel: PathBuf, problems: Vec<String>, ok: &str) -> Result<String, WheelError> {
    if problems.is_empty() {
        Ok(format!("wheel: {} {ok}", wheel.display()))
    } else {
        Err(WheelError::Invalid { wheel, problems })
    }
}

/// `bin/<name>` of the venv.
fn venv_bin(venv: &Path, name: &str) -> PathBuf {
    venv.join("bin").join(name)
}

/// The venv at `dir` with [`TOOLS`] installed (made, or updated, when its stamp differs).
fn ensure_venv(env: &ToolchainEnv, dir: &Path) -> Result<PathBuf, WheelError> {
    let stamp = dir.join(TOOLS_STAMP);
    let wanted = TOOLS.join("\n");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && venv_bin(dir, "python").exists() {
        return Ok(dir.to_path_buf());
    }
    if !venv_bin(dir, "python").exists() {
        let mut venv = Command::new(&env.python);
        venv.args(["-m", "venv"]).arg(dir);
        println!("wheel: $ {}", command_line(&venv));
        util::run_captured(&mut venv)?;
    }
    let mut pip = Command::new(venv_bin(dir, "python"));
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .args(TOOLS);
    println!("wheel: $ {}", command_line(&pip));
    util::run_inherited(&mut pip)?;
    fs::write(&stamp, wanted).map_err(XtaskError::io("writing", &stamp))?;
    Ok(dir.to_path_buf())
}

/// `python -m pip install --force-reinstall --no-deps <wheel>`.
fn pip_install(python: &Path, wheel: &Path) -> Result<(), WheelError> {
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "-q",
        "--force-reinstall",
        "--no-deps",
    ])
    .arg(wheel);
    println!("wheel: $ {}", command_line(&pip));
    Ok(util::run_inherited(&mut pip)?)
}

/// The package's wheels in `dir`, by file name.
fn wheels_in(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("{DIST}-")) && n.ends_with(".whl"))
        .collect();
    found.sort();
    found
}

/// The one wheel of the package in `dir`.
fn the_wheel(dir: &Path) -> Result<PathBuf, WheelError> {
    match wheels_in(dir).as_slice() {
        [one] => Ok(dir.join(one)),
        found => Err(WheelError::WheelCount {
            dir: dir.to_path_buf(),
            found: found.to_vec(),
        }),
    }
}

/// Removes earlier wheels of the package, so that the build leaves exactly one.
fn remove_old_wheels(dir: &Path) -> Result<(), WheelError> {
    for name in wheels_in(dir) {
        let p = dir.join(name);
        fs::remove_file(&p).map_err(XtaskError::io("removing", &p))?;
    }
    Ok(())
}

/// Unpacks `wheel` (a zip) into `<dir>/.unpacked` with Python's standard library.
fn unpack(env: &ToolchainEnv, wheel: &Path, dir: &Path) -> Result<PathBuf, WheelError> {
    let out = dir.join(".unpacked");
    if out.exists() {
        fs::remove_dir_all(&out).map_err(XtaskError::io("removing", &out))?;
    }
    let mut unzip = Command::new(&env.python);
    unzip.args(["-m", "zipfile", "-e"]).arg(wheel).arg(&out);
    util::run_captured(&mut unzip)?;
    Ok(out)
}

/// The kernel artifacts the native module must embed: every image of `kernels/images.txt`, in
/// the kernel output directory.
fn kernel_artifacts(paths: &Paths) -> Result<Vec<PathBuf>, WheelError> {
    Ok(kernels::read_images(&paths.workspace)?
        .into_iter()
        .map(|k| paths.out_dir.join(k.artifact))
        .collect())
}

/// What is wrong with an unpacked wheel: every `.py` file of `python/epcomm` must be there
/// with the same content, the native module must be there, and it must hold every kernel
/// artifact of `artifacts` byte for byte.
pub fn verify(
    unpacked: &Path,
    python_src: &Path,
    artifacts: &[PathBuf],
) -> Result<Vec<String>, WheelError> {
    let mut problems = Vec::new();
    let pkg = python_src.join(DIST);
    let mut sources: Vec<PathBuf> = fs::read_dir(&pkg)
        .map_err(XtaskError::io("listing", &pkg))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    sources.sort();
    for src in sources {
        let name = src.file_name().map(PathBuf::from).unwrap_or_default();
        let packed = unpacked.join(DIST).join(&name);
        let want = fs::read(&src).map_err(XtaskError::io("reading", &src))?;
        match fs::read(&packed) {
            Ok(got) if got == want => {}
            Ok(_) => problems.push(format!(
                "{DIST}/{} differs from python/{DIST}/{0}",
                name.display()
            )),
            Err(_) => problems.push(format!("{DIST}/{} is missing", name.display())),
        }
    }
    let native = fs::read_dir(unpacked.join(DIST))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("_native") && n.ends_with(".so"))
        });
    let Some(native) = native else {
        problems.push(format!("the native module {DIST}/_native*.so is missing"));
        return Ok(problems);
    };
    let module = fs::read(&native).map_err(XtaskError::io("reading", &native))?;
    for a in artifacts {
        let Ok(bytes) = fs::read(a) else {
            problems.push(format!(
                "the kernel artifact {} is missing (run `cargo xtask build-kernels`)",
                a.display()
            ));
            continue;
        };
        if !contains(&module, &bytes) {
            problems.push(format!(
                "the native module does not embed {} as it is now",
                a.display()
            ));
        }
    }
    Ok(problems)
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || hay.windows(needle.len()).any(|w| w == needle)
}

/// The crate of the native module.
const NATIVE_CRATE: &str = "epcomm-py";

/// Inputs of the wheel changed after it was built: the Rust sources and manifests of the
/// native module's crate and of every workspace crate it depends on (normal dependencies,
/// transitively), `Cargo.lock` and `python/pyproject.toml` (the Python files and the kernels
/// are compared by content in [`verify`]).
fn newer_inputs(wheel: &Path, ws: &Path) -> Result<Vec<String>, WheelError> {
    let built = modified(wheel)?;
    let mut inputs = vec![ws.join("Cargo.lock"), ws.join("python/pyproject.toml")];
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo.current_dir(ws).args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]);
    let out = util::run_captured(&mut cargo)?;
    let metadata: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|source| XtaskError::CargoJson {
            line: String::from_utf8_lossy(&out.stdout)
                .chars()
                .take(200)
                .collect(),
            source,
        })?;
    for dir in crate_dirs(&metadata, NATIVE_CRATE) {
        collect_sources(&dir, &mut inputs)?;
    }
    let mut newer = Vec::new();
    for p in inputs {
        if modified(&p)? > built {
            newer.push(format!(
                "{} changed after the wheel was built",
                util::relative_to(ws, &p)
            ));
        }
    }
    Ok(newer)
}

/// The directories of workspace package `root` and of every workspace package it depends on
/// (normal dependencies, transitively), from `cargo metadata --no-deps` output.
fn crate_dirs(metadata: &serde_json::Value, root: &str) -> Vec<PathBuf> {
    let packages = metadata["packages"].as_array().cloned().unwrap_or_default();
    let dir_of = |p: &serde_json::Value| {
        p["manifest_path"]
            .as_str()
            .and_then(|m| Path::new(m).parent().map(Path::to_path_buf))
    };
    let mut todo = vec![root.to_string()];
    let mut seen: Vec<String> = Vec::new();
    let mut dirs = Vec::new();
    while let Some(name) = todo.pop() {
        if seen.contains(&name) {
            continue;
        }
        seen.push(name.clone());
        let Some(p) = packages.iter().find(|p| p["name"] == name.as_str()) else {
            continue;
        };
        dirs.extend(dir_of(p));
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let normal = d["kind"].is_null();
            if let (true, Some(dep), Some(_)) = (normal, d["name"].as_str(), d["path"].as_str()) {
                todo.push(dep.to_string());
            }
        }
    }
    dirs.sort();
    dirs
}

/// Every `*.rs` and `Cargo.toml` under `dir`.
fn collect_sources(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), WheelError> {
    for entry in fs::read_dir(dir)
        .map_err(XtaskError::io("listing", dir))?
        .flatten()
    {
        let p = entry.path();
        if p.is_dir() {
            collect_sources(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs")
            || p.file_name().is_some_and(|n| n == "Cargo.toml")
        {
            out.push(p);
        }
    }
    Ok(())
}

fn modified(p: &Path) -> Result<SystemTime, WheelError> {
    Ok(fs::metadata(p)
        .and_then(|m| m.modified())
        .map_err(XtaskError::io("reading the time of", p))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

    /// An unpacked wheel and the sources it was made from: `python/epcomm/{__init__,buffer}.py`,
    /// `kernels/{a.fatbin,b.cubin}`, and a native module embedding both artifacts.
    fn fixture() -> TempDir {
        let t = TempDir::new("wheel");
        t.write("python/epcomm/__init__.py", "from . import _native\n");
        t.write("python/epcomm/buffer.py", "class Buffer: ...\n");
        t.write("python/epcomm/py.typed", "");
        t.write("kernels/a.fatbin", "FATBIN-A");
        t.write("kernels/b.cubin", "CUBIN-B");
        t.write("kernels/manifest.json", "{}");
        t.write("wheel/epcomm/__init__.py", "from . import _native\n");
        t.write("wheel/epcomm/buffer.py", "class Buffer: ...\n");
        t.write(
            "wheel/epcomm/_native.abi3.so",
            "\x7fELF...FATBIN-A...CUBIN-B...",
        );
        t
    }

    fn check(t: &TempDir) -> Vec<String> {
        let p = t.path();
        let artifacts = [p.join("kernels/a.fatbin"), p.join("kernels/b.cubin")];
        verify(&p.join("wheel"), &p.join("python"), &artifacts).unwrap()
    }

    #[test]
    fn a_complete_wheel_passes() {
        let t = fixture();
        assert_eq!(check(&t), Vec::<String>::new());
    }

    #[test]
    fn stale_or_missing_python_files_are_named() {
        let t = fixture();
        t.write("python/epcomm/buffer.py", "class Buffer: pass\n");
        t.write("python/epcomm/stats.py", "");
        let problems = check(&t);
        assert_eq!(
            problems,
            vec![
                "epcomm/buffer.py differs from python/epcomm/buffer.py".to_string(),
                "epcomm/stats.py is missing".to_string()
            ]
        );
    }

    #[test]
    fn the_native_module_must_embed_every_kernel_as_built() {
        let t = fixture();
        t.write("kernels/b.cubin", "CUBIN-B2");
        let problems = check(&t);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("b.cubin"), "{problems:?}");
        fs::remove_file(t.path().join("wheel/epcomm/_native.abi3.so")).unwrap();
        assert_eq!(
            check(&t),
            vec!["the native module epcomm/_native*.so is missing".to_string()]
        );
    }

    #[test]
    fn a_missing_kernel_is_a_problem_and_other_files_do_not_count() {
        let t = fixture();
        t.write("kernels/.b.rdc.123.cubin", "a temporary file of a build");
        assert_eq!(check(&t), Vec::<String>::new());
        fs::remove_file(t.path().join("kernels/b.cubin")).unwrap();
        let problems = check(&t);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("b.cubin is missing"), "{problems:?}");
    }

    #[test]
    fn exactly_one_wheel_is_expected() {
        let t = TempDir::new("wheels");
        let e = the_wheel(t.path()).unwrap_err().to_string();
        assert!(
            e.contains("found 0") && e.contains("cargo xtask wheel"),
            "{e}"
        );
        t.write("epcomm-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl", "");
        t.write("other-1.0-py3-none-any.whl", "");
        let one = the_wheel(t.path()).unwrap();
        assert!(one.ends_with("epcomm-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl"));
        t.write("epcomm-0.0.9-cp39-abi3-manylinux_2_34_x86_64.whl", "");
        let e = the_wheel(t.path()).unwrap_err().to_string();
        assert!(e.contains("found 2"), "{e}");
        remove_old_wheels(t.path()).unwrap();
        assert!(wheels_in(t.path()).is_empty());
        assert!(t.path().join("other-1.0-py3-none-any.whl").exists());
    }

    #[test]
    fn the_native_crate_depends_on_its_path_dependencies_only() {
        let metadata = serde_json::json!({"packages": [
            {"name": "epcomm-py", "manifest_path": "/w/crates/epcomm-py/Cargo.toml", "dependencies": [
                {"name": "epcomm", "path": "/w/crates/epcomm", "kind": null},
                {"name": "pyo3", "kind": null},
                {"name": "epcomm-check", "path": "/w/crates/epcomm-check", "kind": "dev"}
            ]},
            {"name": "epcomm", "manifest_path": "/w/crates/epcomm/Cargo.toml", "dependencies": [
                {"name": "epcomm-topology", "path": "/w/crates/epcomm-topology", "kind": null}
            ]},
            {"name": "epcomm-topology", "manifest_path": "/w/crates/epcomm-topology/Cargo.toml",
             "dependencies": [{"name": "epcomm", "path": "/w/crates/epcomm", "kind": null}]},
            {"name": "epcomm-check", "manifest_path": "/w/crates/epcomm-check/Cargo.toml",
             "dependencies": []}
        ]});
        let dirs = crate_dirs(&metadata, "epcomm-py");
        let names: Vec<_> = dirs.iter().map(|d| d.display().to_string()).collect();
        assert_eq!(
            names,
            [
                "/w/crates/epcomm",
                "/w/crates/epcomm-py",
                "/w/crates/epcomm-topology"
            ]
        );
    }

    #[test]
    fn search_finds_embedded_bytes() {
        assert!(contains(b"xxABCxx", b"ABC"));
        assert!(!contains(b"xxABxCx", b"ABC"));
        assert!(!contains(b"AB", b"ABC"));
    }
}
