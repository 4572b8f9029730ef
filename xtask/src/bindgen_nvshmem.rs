//! `cargo xtask bindgen-nvshmem [--check]`: generate `crates/nvshmem-sys/src/bindings.rs`.
//!
//! The bindings are vendored: `nvshmem-sys` has no build script and never needs NVSHMEM or
//! libclang to build. This command is the only way they are (re)generated. It runs the pinned
//! `bindgen` library against the headers of the pinned pip NVSHMEM 3.4.5
//! (`target/cuda-toolchain/nvidia/nvshmem/include`, plus the CUDA and CCCL include directories of
//! the same pip toolchain), parsing them as C++17 with `-DNVSHMEM_HOSTLIB_ONLY` (the macro
//! `nvshmem.h`, `nvshmemx.h` and `host/nvshmem_macros.h` test to leave out the device headers),
//! with an explicit allowlist and bindgen's dynamic-loading mode (a struct of function pointers
//! filled through `libloading`, so nothing links at build time). The output is piped through
//! `rustfmt` with the workspace `rustfmt.toml` so `cargo fmt --check` accepts it.
//!
//! `--check` regenerates into `target/nvshmem-sys-bindings.check.rs` and fails when it differs
//! from the committed file. When libclang or the headers are missing it prints why and succeeds
//! (CI machines may have neither); plain generation fails instead.

use std::fmt;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::toolchain::pip_nvshmem;

/// The NVSHMEM release the bindings describe; recorded in the generated header.
pub const NVSHMEM_VERSION: &str = "3.4.5";

/// Name of the generated dynamic-loading struct.
pub const LIBRARY_STRUCT: &str = "NvshmemHost";

/// Host-library functions bound. Everything else (device API, the `static inline`
/// `nvshmem_init`/`nvshmemx_init_attr` family that lives in the device archive) is left out.
pub const FUNCTIONS: &[&str] = &[
    "nvshmemx_hostlib_init_attr",
    "nvshmemx_hostlib_finalize",
    "nvshmemx_set_attr_uniqueid_args",
    "nvshmemx_get_uniqueid",
    "nvshmemx_init_status",
    // The OpenSHMEM *spec* version (1.3 in NVSHMEM 3.4.5), not the release.
    "nvshmem_info_get_version",
    // The NVSHMEM release (3.4.5); what the loader checks.
    "nvshmemx_vendor_get_version_info",
    "nvshmem_malloc",
    "nvshmem_align",
    "nvshmem_calloc",
    "nvshmem_free",
    "nvshmem_ptr",
    "nvshmem_my_pe",
    "nvshmem_n_pes",
    "nvshmem_team_my_pe",
    "nvshmem_team_n_pes",
    "nvshmem_barrier_all",
    "nvshmemx_barrier_all_on_stream",
    "nvshmem_quiet",
    "nvshmemx_quiet_on_stream",
    "nvshmemx_cumodule_init",
    "nvshmemx_cumodule_finalize",
    // Local (non-symmetric) memory a put reads from: registered with every transport NVSHMEM
    // initialised (a network transport registers it with the NIC), unregistered before it is
    // freed or NVSHMEM is finalised.
    "nvshmemx_buffer_register",
    "nvshmemx_buffer_unregister",
];

/// Types bound (their enumerators come with them as constants).
pub const TYPES: &[&str] = &[
    "nvshmemx_uniqueid_t",
    "nvshmemx_uniqueid_v1",
    "nvshmemx_uniqueid_args_t",
    "nvshmemx_uniqueid_args_v1",
    "nvshmemx_init_args_t",
    "nvshmemx_init_args_v1",
    "nvshmemx_init_attr_t",
    "nvshmemx_init_attr_v1",
    "nvshmem_team_t",
    // `enum flags { NVSHMEMX_INIT_THREAD_PES, …, NVSHMEMX_INIT_WITH_UNIQUEID = 1 << 3, … }`
    "flags",
    // NVSHMEM_TEAM_WORLD, NVSHMEMX_TEAM_NODE, …
    "nvshmem_team_id_t",
    // NVSHMEM_STATUS_NOT_INITIALIZED, …
    "nvshmemx_init_status_t",
    // NVSHMEMX_SUCCESS, NVSHMEMX_ERROR_INVALID_VALUE, … (the status codes calls return)
    "nvshmemx_status",
];

/// Macros bound as constants.
pub const VARS: &[&str] = &[
    "NVSHMEM_VENDOR_MAJOR_VERSION",
    "NVSHMEM_VENDOR_MINOR_VERSION",
    "NVSHMEM_VENDOR_PATCH_VERSION",
    "NVSHMEM_VENDOR_PACKAGE_VERSION",
    "NVSHMEM_MAJOR_VERSION",
    "NVSHMEM_MINOR_VERSION",
    "UNIQUEID_PADDING",
    "UNIQUEID_ARGS_INVALID",
    "INIT_ARGS_PADDING",
    "NVSHMEM_INIT_ATTR_VER",
];

/// Where the inputs and the output of the generation live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindgenPaths {
    /// `…/nvidia/nvshmem/include` (holds `nvshmem_host.h`).
    pub nvshmem_include: PathBuf,
    /// `…/nvidia/cu13/include` (holds `cuda.h`, `cuda_runtime.h`).
    pub cuda_include: PathBuf,
    /// `…/nvidia/cu13/include/cccl` (holds `cuda/std/…`).
    pub cccl_include: PathBuf,
    /// The workspace `rustfmt.toml` the output is formatted with.
    pub rustfmt_config: PathBuf,
    /// The committed bindings, `crates/nvshmem-sys/src/bindings.rs`.
    pub output: PathBuf,
    /// Where `--check` writes the fresh generation, for diffing.
    pub check_output: PathBuf,
}

impl BindgenPaths {
    /// The paths for `workspace`, whose pinned pip toolchain is installed under `pip_root`.
    pub fn new(workspace: &Path, pip_root: &Path) -> BindgenPaths {
        let cuda_include = pip_root.join("nvidia/cu13/include");
        BindgenPaths {
            nvshmem_include: pip_nvshmem(pip_root).join("include"),
            cccl_include: cuda_include.join("cccl"),
            cuda_include,
            rustfmt_config: workspace.join("rustfmt.toml"),
            output: workspace.join("crates/nvshmem-sys/src/bindings.rs"),
            check_output: workspace.join("target/nvshmem-sys-bindings.check.rs"),
        }
    }

    /// The header files generation needs, each paired with what it is; those absent are
    /// returned.
    pub fn missing_inputs(&self) -> Vec<PathBuf> {
        [
            self.nvshmem_include.join("nvshmem_host.h"),
            self.nvshmem_include.join("non_abi/nvshmem_version.h"),
            self.cuda_include.join("cuda.h"),
            self.cuda_include.join("cuda_runtime.h"),
            self.cccl_include.join("cuda/std/tuple"),
        ]
        .into_iter()
        .filter(|p| !p.is_file())
        .collect()
    }
}

/// Why generation could not run at all (as opposed to failing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// Header files that are not there.
    Headers(Vec<PathBuf>),
    /// libclang could not be loaded; clang-sys's explanation.
    Libclang(String),
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::Headers(missing) => {
                write!(
                    f,
                    "the pinned NVSHMEM {NVSHMEM_VERSION}/CUDA headers are missing:"
                )?;
                for p in missing {
                    write!(f, "\n  - {}", p.display())?;
                }
                write!(
                    f,
                    "\n(`cargo xtask build-kernels` installs the pinned pip toolchain into target/cuda-toolchain)"
                )
            }
            Unavailable::Libclang(why) => write!(
                f,
                "libclang could not be loaded ({why}); install it (e.g. `apt-get install libclang1-14 \
                 libclang-common-14-dev`) or point LIBCLANG_PATH at the directory holding libclang.so"
            ),
        }
    }
}

/// Everything `bindgen-nvshmem` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BindgenNvshmemError {
    /// Plain generation was asked for but cannot run.
    #[error("cannot generate NVSHMEM bindings: {0}")]
    Unavailable(Unavailable),
    /// bindgen (libclang) rejected the headers.
    #[error("bindgen failed on the NVSHMEM headers: {0}")]
    Bindgen(#[from] bindgen::BindgenError),
    /// The pinned bindgen does not support the Rust target the bindings are generated for.
    #[error("bindgen rejected Rust target 1.85: {0}")]
    RustTarget(String),
    /// rustfmt could not be run or rejected the output.
    #[error("`{command}` failed: {why}")]
    Rustfmt {
        /// The command line.
        command: String,
        /// Its stderr, or the spawn error.
        why: String,
    },
    /// The generated source does not contain the text the libloading patch rewrites.
    #[error(
        "the generated bindings contain `{pattern}` {found} times, expected once: bindgen's \
         dynamic-loading output changed; update `patch_for_libloading`"
    )]
    UnexpectedOutput {
        /// The text looked for.
        pattern: &'static str,
        /// How often it occurs.
        found: usize,
    },
    /// Reading or writing a file failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--check` found the committed bindings out of date.
    #[error(
        "{} is out of date ({stale}); the fresh generation is in {}. Run `cargo xtask bindgen-nvshmem` \
         and commit the result.",
        committed.display(),
        fresh.display()
    )]
    Stale {
        /// The committed file.
        committed: PathBuf,
        /// The fresh generation.
        fresh: PathBuf,
        /// Where they first differ.
        stale: Staleness,
    },
}

/// How the committed bindings differ from a fresh generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Staleness {
    /// There is no committed file.
    Missing,
    /// First differing line (1-based) with both versions of it (`None`: that file has ended).
    Differs {
        /// 1-based line number.
        line: usize,
        /// The committed line.
        committed: Option<String>,
        /// The freshly generated line.
        fresh: Option<String>,
    },
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Staleness::Missing => write!(f, "the file does not exist"),
            Staleness::Differs {
                line,
                committed,
                fresh,
            } => {
                let show = |l: &Option<String>| match l {
                    Some(s) => format!("`{s}`"),
                    None => "end of file".to_string(),
                };
                write!(
                    f,
                    "first difference at line {line}: committed {}, generated {}",
                    show(committed),
                    show(fresh)
                )
            }
        }
    }
}

/// Compares the committed bindings (`None`: no file) with a fresh generation.
/// `Ok(())` when they are identical.
pub fn compare(committed: Option<&str>, fresh: &str) -> Result<(), Staleness> {
    let Some(committed) = committed else {
        return Err(Staleness::Missing);
    };
    if committed == fresh {
        return Ok(());
    }
    let mut a = committed.lines();
    let mut b = fresh.lines();
    let mut line = 0;
    loop {
        line += 1;
        let (x, y) = (a.next(), b.next());
        if x != y || (x.is_none() && y.is_none()) {
            // Both ended with equal lines: the files differ only in trailing newlines.
            return Err(Staleness::Differs {
                line,
                committed: x.map(str::to_string),
                fresh: y.map(str::to_string),
            });
        }
    }
}

/// What the command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The bindings were (re)written.
    Written(PathBuf),
    /// `--check`: the committed bindings match a fresh generation.
    UpToDate(PathBuf),
    /// `--check`: generation could not run, nothing was checked.
    Skipped(Unavailable),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Written(p) => write!(f, "wrote {}", p.display()),
            Outcome::UpToDate(p) => write!(f, "{} is up to date", p.display()),
            Outcome::Skipped(why) => write!(f, "skipped the NVSHMEM bindings check: {why}"),
        }
    }
}

/// Decides whether generation can run: headers first (cheap), then libclang via `load_libclang`.
pub fn preflight(
    paths: &BindgenPaths,
    load_libclang: impl FnOnce() -> Result<(), String>,
) -> Result<(), Unavailable> {
    let missing = paths.missing_inputs();
    if !missing.is_empty() {
        return Err(Unavailable::Headers(missing));
    }
    load_libclang().map_err(Unavailable::Libclang)
}

/// Runs the command: generates (or, with `check`, verifies) the committed bindings.
pub fn run(paths: &BindgenPaths, check: bool) -> Result<Outcome, BindgenNvshmemError> {
    if let Err(why) = preflight(paths, clang_sys::load) {
        return if check {
            Ok(Outcome::Skipped(why))
        } else {
            Err(BindgenNvshmemError::Unavailable(why))
        };
    }
    let fresh = patch_for_libloading(&format_rust(&generate(paths)?, &paths.rustfmt_config)?)?;
    if !check {
        write(&paths.output, &fresh)?;
        return Ok(Outcome::Written(paths.output.clone()));
    }
    write(&paths.check_output, &fresh)?;
    let committed = match fs::read_to_string(&paths.output) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(BindgenNvshmemError::Io {
                action: "reading",
                path: paths.output.clone(),
                source,
            });
        }
    };
    match compare(committed.as_deref(), &fresh) {
        Ok(()) => Ok(Outcome::UpToDate(paths.output.clone())),
        Err(stale) => Err(BindgenNvshmemError::Stale {
            committed: paths.output.clone(),
            fresh: paths.check_output.clone(),
            stale,
        }),
    }
}

fn write(path: &Path, contents: &str) -> Result<(), BindgenNvshmemError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(|source| BindgenNvshmemError::Io {
            action: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    fs::write(path, contents).map_err(|source| BindgenNvshmemError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

/// The clang arguments: C++17, host-library-only headers, the three include directories.
pub fn clang_args(paths: &BindgenPaths) -> Vec<String> {
    vec![
        "-x".into(),
        "c++".into(),
        "-std=c++17".into(),
        "-DNVSHMEM_HOSTLIB_ONLY".into(),
        format!("-I{}", paths.nvshmem_include.display()),
        format!("-I{}", paths.cuda_include.display()),
        format!("-I{}", paths.cccl_include.display()),
    ]
}

/// Exact-name regex for bindgen's allowlists.
fn exact(name: &str) -> String {
    format!("^{name}$")
}

/// Runs bindgen; returns the unformatted Rust source.
fn generate(paths: &BindgenPaths) -> Result<String, BindgenNvshmemError> {
    let target = bindgen::RustTarget::stable(85, 0)
        .map_err(|e| BindgenNvshmemError::RustTarget(e.to_string()))?;
    let mut builder = bindgen::Builder::default()
        .header_contents("nvshmem_sys_wrapper.hpp", "#include <nvshmem_host.h>\n")
        .clang_args(clang_args(paths))
        .rust_target(target)
        .rust_edition(bindgen::RustEdition::Edition2024)
        .dynamic_library_name(LIBRARY_STRUCT)
        .dynamic_link_require_all(true)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .generate_comments(false)
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(true)
        .derive_copy(true)
        .formatter(bindgen::Formatter::None)
        .raw_line(format!(
            "// @generated by `cargo xtask bindgen-nvshmem` (bindgen 0.71.1) from the NVSHMEM \
             {NVSHMEM_VERSION} host headers. Do not edit."
        ));
    for f in FUNCTIONS {
        builder = builder.allowlist_function(exact(f));
    }
    for t in TYPES {
        builder = builder.allowlist_type(exact(t));
    }
    for v in VARS {
        builder = builder.allowlist_var(exact(v));
    }
    Ok(builder.generate()?.to_string())
}

/// What bindgen 0.71.1 writes as the bound of `NvshmemHost::new`'s path parameter.
const LIBLOADING_08_BOUND: &str = "P: AsRef<::std::ffi::OsStr>,";
/// The bound `libloading` 0.9's `Library::new` takes instead.
const LIBLOADING_09_BOUND: &str = "P: ::libloading::AsFilename,";

/// Adapts bindgen 0.71.1's dynamic-loading constructor to libloading 0.9 (the workspace's
/// version): `Library::new` there takes `impl AsFilename`, not `impl AsRef<OsStr>`.
///
/// # Errors
/// [`BindgenNvshmemError::UnexpectedOutput`] unless the old bound occurs exactly once.
pub fn patch_for_libloading(source: &str) -> Result<String, BindgenNvshmemError> {
    let found = source.matches(LIBLOADING_08_BOUND).count();
    if found != 1 {
        return Err(BindgenNvshmemError::UnexpectedOutput {
            pattern: LIBLOADING_08_BOUND,
            found,
        });
    }
    Ok(source.replace(LIBLOADING_08_BOUND, LIBLOADING_09_BOUND))
}

/// Formats `source` with `rustfmt` (edition 2024, the workspace config); `$RUSTFMT` overrides
/// the program.
fn format_rust(source: &str, config: &Path) -> Result<String, BindgenNvshmemError> {
    let program = std::env::var_os("RUSTFMT").unwrap_or_else(|| "rustfmt".into());
    let mut cmd = Command::new(&program);
    cmd.args(["--edition", "2024", "--emit", "stdout"]);
    if config.is_file() {
        cmd.arg("--config-path").arg(config);
    }
    let line = crate::util::command_line(&cmd);
    let fail = |why: String| BindgenNvshmemError::Rustfmt {
        command: line.clone(),
        why,
    };
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| fail("no stdin pipe".into()))?;
    let input = source.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    writer
        .join()
        .map_err(|_| fail("the thread writing to rustfmt panicked".into()))?
        .map_err(|e| fail(format!("writing to its stdin: {e}")))?;
    if !out.status.success() {
        return Err(fail(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    String::from_utf8(out.stdout).map_err(|e| fail(format!("non-UTF-8 output: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

    fn paths_in(dir: &Path) -> BindgenPaths {
        BindgenPaths::new(dir, &dir.join("target/cuda-toolchain"))
    }

    #[test]
    fn identical_files_are_up_to_date() {
        assert_eq!(compare(Some("a\nb\n"), "a\nb\n"), Ok(()));
    }

    #[test]
    fn missing_committed_file_is_stale() {
        assert_eq!(compare(None, "a\n"), Err(Staleness::Missing));
    }

    #[test]
    fn first_differing_line_is_reported_with_both_versions() {
        let err = compare(Some("a\nb\nc\n"), "a\nB\nc\n").unwrap_err();
        assert_eq!(
            err,
            Staleness::Differs {
                line: 2,
                committed: Some("b".into()),
                fresh: Some("B".into())
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("line 2") && msg.contains("`b`") && msg.contains("`B`"),
            "{msg}"
        );
    }

    #[test]
    fn a_shorter_file_differs_at_its_end() {
        let err = compare(Some("a\n"), "a\nb\n").unwrap_err();
        assert_eq!(
            err,
            Staleness::Differs {
                line: 2,
                committed: None,
                fresh: Some("b".into())
            }
        );
        assert!(err.to_string().contains("end of file"));
    }

    #[test]
    fn trailing_newline_only_difference_is_stale() {
        assert!(matches!(
            compare(Some("a\n"), "a"),
            Err(Staleness::Differs { line: 2, .. })
        ));
    }

    #[test]
    fn preflight_lists_every_missing_header_and_skips_libclang() {
        let dir = TempDir::new("bindgen-missing");
        let paths = paths_in(dir.path());
        let err = preflight(&paths, || panic!("libclang must not be probed")).unwrap_err();
        let Unavailable::Headers(missing) = &err else {
            panic!("expected missing headers, got {err:?}");
        };
        assert_eq!(missing.len(), 5, "{missing:?}");
        let msg = err.to_string();
        for p in missing {
            assert!(msg.contains(&p.display().to_string()), "{msg}");
        }
        assert!(msg.contains("nvshmem_host.h") && msg.contains("cuda/std/tuple"));
    }

    #[test]
    fn preflight_reports_libclang_when_headers_exist() {
        let dir = TempDir::new("bindgen-headers");
        let paths = paths_in(dir.path());
        for p in paths.missing_inputs() {
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, "").unwrap();
        }
        assert!(paths.missing_inputs().is_empty());
        let err = preflight(&paths, || Err("no libclang.so in /nowhere".into())).unwrap_err();
        assert_eq!(
            err,
            Unavailable::Libclang("no libclang.so in /nowhere".into())
        );
        assert!(err.to_string().contains("LIBCLANG_PATH"));
        assert_eq!(preflight(&paths, || Ok(())), Ok(()));
    }

    #[test]
    fn check_without_inputs_skips_and_generation_fails() {
        let dir = TempDir::new("bindgen-run");
        let paths = paths_in(dir.path());
        assert!(matches!(
            run(&paths, true),
            Ok(Outcome::Skipped(Unavailable::Headers(_)))
        ));
        assert!(matches!(
            run(&paths, false),
            Err(BindgenNvshmemError::Unavailable(Unavailable::Headers(_)))
        ));
        assert!(!paths.output.exists() && !paths.check_output.exists());
    }

    #[test]
    fn clang_args_parse_cxx17_host_only_with_all_include_dirs() {
        let paths = paths_in(Path::new("/ws"));
        let args = clang_args(&paths);
        assert!(args.contains(&"-std=c++17".to_string()));
        assert!(args.contains(&"-DNVSHMEM_HOSTLIB_ONLY".to_string()));
        for dir in [
            "/ws/target/cuda-toolchain/nvidia/nvshmem/include",
            "/ws/target/cuda-toolchain/nvidia/cu13/include",
            "/ws/target/cuda-toolchain/nvidia/cu13/include/cccl",
        ] {
            assert!(args.contains(&format!("-I{dir}")), "{args:?}");
        }
        assert_eq!(
            paths.output,
            Path::new("/ws/crates/nvshmem-sys/src/bindings.rs")
        );
    }

    #[test]
    fn libloading_patch_rewrites_the_bound_exactly_once() {
        let src = "pub unsafe fn new<P>(path: P)\nwhere\n    P: AsRef<::std::ffi::OsStr>,\n{}\n";
        let out = patch_for_libloading(src).expect("patched");
        assert!(out.contains("P: ::libloading::AsFilename,") && !out.contains("AsRef"));
        assert!(matches!(
            patch_for_libloading("nothing here"),
            Err(BindgenNvshmemError::UnexpectedOutput { found: 0, .. })
        ));
        let twice = format!("{src}{src}");
        assert!(matches!(
            patch_for_libloading(&twice),
            Err(BindgenNvshmemError::UnexpectedOutput { found: 2, .. })
        ));
    }

    #[test]
    fn allowlist_leaves_out_the_static_inline_initialisers() {
        for f in ["nvshmem_init", "nvshmemx_init_attr", "nvshmemi_init_thread"] {
            assert!(!FUNCTIONS.contains(&f), "{f} lives in the device archive");
        }
        assert!(FUNCTIONS.contains(&"nvshmemx_hostlib_init_attr"));
    }

    /// The committed bindings match a fresh generation, when this machine can generate.
    #[test]
    fn committed_bindings_are_up_to_date_when_generation_is_possible() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut paths = BindgenPaths::new(workspace, &workspace.join("target/cuda-toolchain"));
        let dir = TempDir::new("bindgen-check");
        paths.check_output = dir.path().join("fresh.rs");
        match run(&paths, true) {
            Ok(Outcome::Skipped(why)) => eprintln!("skipped: {why}"),
            Ok(Outcome::UpToDate(_)) => {}
            other => panic!("{other:?}"),
        }
    }
}
