//! Finding (and, when needed, installing) the CUDA toolchain: nvcc, nvlink, CCCL and NVSHMEM.
//!
//! Discovery order for nvcc: `$CUDA_HOME/bin/nvcc`, then `nvcc` on `PATH`, then the pinned PyPI
//! toolchain under `<workspace>/target/cuda-toolchain` (installed there with pip when missing).
//! NVSHMEM comes from `$NVSHMEM_HOME` or the same pinned toolchain.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::util::{self, combined_output, command_line, find_in_path, is_executable};

/// The pinned PyPI packages; versions must match the GPU machine (driver CUDA 13.0, NVSHMEM 3.4.5).
pub const PIP_PACKAGES: [&str; 6] = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvshmem-cu13==3.4.5",
];

/// The CUDA version the GPU machine's driver supports; newer nvcc emits PTX it cannot JIT.
const DRIVER_CUDA: (u32, u32) = (13, 0);

/// Where nvcc in the pinned pip toolchain lives, given its root (`target/cuda-toolchain`).
pub fn pip_nvcc(pip_root: &Path) -> PathBuf {
    pip_root.join("nvidia/cu13/bin/nvcc")
}

/// Where NVSHMEM in the pinned pip toolchain lives, given its root.
pub fn pip_nvshmem(pip_root: &Path) -> PathBuf {
    pip_root.join("nvidia/nvshmem")
}

/// Where NVSHMEM `release` lives when it is not the pinned toolchain's own (each release its own
/// pip target under the toolchain's root: the wheels all install to `nvidia/nvshmem`).
pub fn pip_nvshmem_release(pip_root: &Path, release: &str) -> PathBuf {
    pip_root.join(format!("nvshmem-{release}/nvidia/nvshmem"))
}

/// The NVSHMEM release of an install (`include/non_abi/nvshmem_version.h`'s vendor version),
/// as `major.minor.patch`; `None` when the header is missing or says no version.
pub fn nvshmem_release_at(root: &Path) -> Option<String> {
    let text = std::fs::read_to_string(root.join("include/non_abi/nvshmem_version.h")).ok()?;
    let part = |name: &str| -> Option<u32> {
        text.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("#define"), Some(n), Some(v)) if n == name => v.parse().ok(),
                _ => None,
            }
        })
    };
    Some(format!(
        "{}.{}.{}",
        part("NVSHMEM_VENDOR_MAJOR_VERSION")?,
        part("NVSHMEM_VENDOR_MINOR_VERSION")?,
        part("NVSHMEM_VENDOR_PATCH_VERSION")?
    ))
}

/// Installs NVSHMEM `release` alone into [`pip_nvshmem_release`]'s target.
pub fn install_pip_nvshmem(env: &ToolchainEnv, release: &str) -> Result<()> {
    let target = env.pip_root.join(format!("nvshmem-{release}"));
    let mut cmd = Command::new(&env.python);
    cmd.args(["-m", "pip", "install", "--no-deps", "--upgrade"])
        .args(["--disable-pip-version-check", "--no-input", "--target"])
        .arg(&target)
        .arg(format!("nvidia-nvshmem-cu13=={release}"));
    eprintln!(
        "build-kernels: installing NVSHMEM {release} for its kernel image:\n  $ {}",
        command_line(&cmd)
    );
    util::run_inherited(&mut cmd)
}

/// The inputs of discovery, captured from the process environment (or built by tests).
#[derive(Debug, Clone)]
pub struct ToolchainEnv {
    /// `$CUDA_HOME`, when set and non-empty.
    pub cuda_home: Option<PathBuf>,
    /// `$NVSHMEM_HOME`, when set and non-empty.
    pub nvshmem_home: Option<PathBuf>,
    /// `$PATH`.
    pub path: Option<OsString>,
    /// Root of the pinned pip toolchain, `<workspace>/target/cuda-toolchain`.
    pub pip_root: PathBuf,
    /// The Python used to install the pinned toolchain (`$PYTHON`, default `python3`).
    pub python: OsString,
}

impl ToolchainEnv {
    /// Reads `CUDA_HOME`, `NVSHMEM_HOME`, `PATH` and `PYTHON` from the process environment.
    pub fn from_process(pip_root: PathBuf) -> ToolchainEnv {
        let non_empty = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        ToolchainEnv {
            cuda_home: non_empty("CUDA_HOME"),
            nvshmem_home: non_empty("NVSHMEM_HOME"),
            path: std::env::var_os("PATH"),
            pip_root,
            python: std::env::var_os("PYTHON")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "python3".into()),
        }
    }
}

/// Which rule of the discovery order found nvcc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvccOrigin {
    /// `$CUDA_HOME/bin/nvcc`.
    CudaHome,
    /// `nvcc` on `PATH`.
    Path,
    /// The pinned pip toolchain.
    Pip,
}

impl fmt::Display for NvccOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NvccOrigin::CudaHome => "$CUDA_HOME",
            NvccOrigin::Path => "PATH",
            NvccOrigin::Pip => "pinned pip toolchain",
        })
    }
}

/// Applies the discovery order without running anything.
///
/// Returns the nvcc path and the rule that found it, or, when none matches, a description of
/// every place searched (for the error message).
pub fn locate_nvcc(env: &ToolchainEnv) -> Result<(PathBuf, NvccOrigin), Vec<String>> {
    let mut searched = Vec::new();
    match &env.cuda_home {
        Some(home) => {
            let nvcc = home.join("bin/nvcc");
            if is_executable(&nvcc) {
                return Ok((nvcc, NvccOrigin::CudaHome));
            }
            searched.push(format!(
                "$CUDA_HOME/bin/nvcc = {} (not an executable file)",
                nvcc.display()
            ));
        }
        None => searched.push("$CUDA_HOME/bin/nvcc (CUDA_HOME is not set)".to_string()),
    }
    if let Some(nvcc) = find_in_path("nvcc", env.path.as_deref()) {
        return Ok((nvcc, NvccOrigin::Path));
    }
    searched.push(match &env.path {
        Some(p) => format!("nvcc on PATH ({})", p.to_string_lossy()),
        None => "nvcc on PATH (PATH is not set)".to_string(),
    });
    let pip = pip_nvcc(&env.pip_root);
    if is_executable(&pip) {
        return Ok((pip, NvccOrigin::Pip));
    }
    searched.push(format!("pinned pip toolchain: {} (missing)", pip.display()));
    Err(searched)
}

/// Installs the pinned packages into `env.pip_root` with `python -m pip install --target`.
///
/// `--upgrade` makes pip replace a partial earlier install instead of skipping it.
pub fn install_pip_toolchain(env: &ToolchainEnv) -> Result<()> {
    let mut cmd = Command::new(&env.python);
    cmd.args(["-m", "pip", "install", "--no-deps", "--upgrade"])
        .args(["--disable-pip-version-check", "--no-input", "--target"])
        .arg(&env.pip_root)
        .args(PIP_PACKAGES);
    eprintln!(
        "build-kernels: installing the pinned CUDA toolchain (~165 MB download):\n  $ {}",
        command_line(&cmd)
    );
    util::run_inherited(&mut cmd)
}

/// A parsed `nvcc --version`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvccVersion {
    /// `(major, minor, patch)`, e.g. `(13, 0, 88)`.
    pub number: (u32, u32, u32),
    /// The identifying lines (`release …, V…` and `Build …`), recorded in the manifest and hashed.
    pub text: String,
}

impl NvccVersion {
    /// `major.minor.patch`.
    pub fn short(&self) -> String {
        let (a, b, c) = self.number;
        format!("{a}.{b}.{c}")
    }
}

/// Parses `nvcc --version` output; `None` unless it has a `release X.Y, VX.Y.Z` line.
pub fn parse_nvcc_version(output: &str) -> Option<NvccVersion> {
    let release_line = output
        .lines()
        .map(str::trim)
        .find(|l| l.contains("release ") && l.contains(", V"))?;
    let v = release_line.rsplit(", V").next()?.trim();
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    let number = (parts.next()??, parts.next()??, parts.next()??);
    let mut text = release_line.to_string();
    if let Some(build) = output
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("Build "))
    {
        text.push_str("; ");
        text.push_str(build);
    }
    Some(NvccVersion { number, text })
}

/// A usable nvcc, with what the kernels need from around it.
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// The nvcc binary.
    pub nvcc: PathBuf,
    /// Which rule found it.
    pub origin: NvccOrigin,
    /// Its version.
    pub version: NvccVersion,
    /// The CCCL include directory (`cuda/std/...`) next to nvcc, when the layout has one.
    pub cccl_include: Option<PathBuf>,
}

impl Toolchain {
    /// Finds nvcc (installing the pinned toolchain when `allow_install` and nothing else is
    /// found), runs `nvcc --version` and checks it can target sm_90a.
    pub fn resolve(env: &ToolchainEnv, allow_install: bool) -> Result<Toolchain> {
        let (nvcc, origin) = match locate_nvcc(env) {
            Ok(found) => found,
            Err(searched) if !allow_install => {
                return Err(Error::NvccNotFound {
                    searched,
                    install_error: None,
                });
            }
            Err(searched) => {
                if let Err(e) = install_pip_toolchain(env) {
                    return Err(Error::NvccNotFound {
                        searched,
                        install_error: Some(e.to_string()),
                    });
                }
                let nvcc = pip_nvcc(&env.pip_root);
                if !is_executable(&nvcc) {
                    return Err(Error::NvccNotFound {
                        searched,
                        install_error: Some(format!(
                            "pip finished but {} does not exist",
                            nvcc.display()
                        )),
                    });
                }
                (nvcc, NvccOrigin::Pip)
            }
        };
        if let (Some(home), NvccOrigin::Path | NvccOrigin::Pip) = (&env.cuda_home, origin) {
            eprintln!(
                "build-kernels: warning: CUDA_HOME={} has no bin/nvcc; using {} from {origin}",
                home.display(),
                nvcc.display()
            );
        }
        let out = util::run_captured(Command::new(&nvcc).arg("--version"))?;
        let printed = combined_output(&out);
        let version =
            parse_nvcc_version(&printed).ok_or_else(|| Error::NvccVersionUnrecognised {
                nvcc: nvcc.clone(),
                output: printed.clone(),
            })?;
        if version.number.0 < 12 {
            return Err(Error::NvccTooOld {
                nvcc,
                found: version.short(),
            });
        }
        if (version.number.0, version.number.1) > DRIVER_CUDA {
            eprintln!(
                "build-kernels: warning: {} is CUDA {}, newer than the GPU machine's driver (CUDA {}.{}); \
                 its compute_90 PTX will not JIT there (the sm_90a SASS still loads)",
                nvcc.display(),
                version.short(),
                DRIVER_CUDA.0,
                DRIVER_CUDA.1
            );
        }
        let real = std::fs::canonicalize(&nvcc).unwrap_or_else(|_| nvcc.clone());
        let cccl_include = real
            .parent()
            .and_then(Path::parent)
            .map(|top| top.join("include/cccl"))
            .filter(|p| p.join("cuda").is_dir());
        Ok(Toolchain {
            nvcc,
            origin,
            version,
            cccl_include,
        })
    }

    /// `nvlink` next to (the real path of) nvcc, else on `PATH`.
    pub fn nvlink(&self, path_var: Option<&std::ffi::OsStr>) -> Result<PathBuf> {
        let real = std::fs::canonicalize(&self.nvcc).unwrap_or_else(|_| self.nvcc.clone());
        [&self.nvcc, &real]
            .into_iter()
            .filter_map(|p| p.parent().map(|d| d.join("nvlink")))
            .find(|p| is_executable(p))
            .or_else(|| find_in_path("nvlink", path_var))
            .ok_or_else(|| Error::NvlinkNotFound {
                nvcc: self.nvcc.clone(),
            })
    }
}

/// An NVSHMEM install usable for device linking.
#[derive(Debug, Clone)]
pub struct Nvshmem {
    /// Directory holding `nvshmem.h`.
    pub include: PathBuf,
    /// Directory holding `libnvshmem_device.a`.
    pub lib: PathBuf,
    /// SHA-256 of `libnvshmem_device.a`, part of the inputs hash of every NVSHMEM variant.
    pub device_lib_sha256: String,
}

fn nvshmem_at(root: &Path) -> Option<(PathBuf, PathBuf)> {
    let include = root.join("include");
    let lib = root.join("lib");
    (include.join("nvshmem.h").is_file() && lib.join("libnvshmem_device.a").is_file())
        .then_some((include, lib))
}

/// Where NVSHMEM `release` is, without installing: `$NVSHMEM_HOME` when it is that release,
/// the pinned pip toolchain's own when it is, else the release's own pip target.
pub fn locate_nvshmem_release(env: &ToolchainEnv, release: &str) -> Result<PathBuf, Vec<String>> {
    let mut searched = Vec::new();
    let mut at = |what: &str, root: PathBuf| {
        match (nvshmem_at(&root), nvshmem_release_at(&root)) {
            (Some(_), Some(found)) if found == release => return Some(root),
            (Some(_), found) => searched.push(format!(
                "{what} = {} (NVSHMEM {}, not {release})",
                root.display(),
                found.as_deref().unwrap_or("of unknown release")
            )),
            (None, _) => searched.push(format!(
                "{what} = {} (no include/nvshmem.h or lib/libnvshmem_device.a)",
                root.display()
            )),
        }
        None
    };
    if let Some(home) = &env.nvshmem_home
        && let Some(root) = at("$NVSHMEM_HOME", home.clone())
    {
        return Ok(root);
    }
    if let Some(root) = at("pinned pip toolchain", pip_nvshmem(&env.pip_root)) {
        return Ok(root);
    }
    if let Some(root) = at(
        "its own pip target",
        pip_nvshmem_release(&env.pip_root, release),
    ) {
        return Ok(root);
    }
    Err(searched)
}

impl Nvshmem {
    /// NVSHMEM `release` (`major.minor.patch`, from the image manifest) for device linking:
    /// [`locate_nvshmem_release`], installing it with pip into its own target when
    /// `allow_install` and it is missing; its device library hashed.
    pub fn resolve_release(
        env: &ToolchainEnv,
        release: &str,
        allow_install: bool,
    ) -> Result<Nvshmem> {
        let root = match locate_nvshmem_release(env, release) {
            Ok(root) => root,
            Err(searched) if !allow_install => {
                return Err(Error::NvshmemNotFound {
                    searched,
                    install_error: None,
                });
            }
            Err(searched) => {
                // The pinned release comes with the pinned toolchain; another with its own
                // pip target.
                let pinned = PIP_PACKAGES
                    .iter()
                    .any(|p| *p == format!("nvidia-nvshmem-cu13=={release}"));
                let installed = if pinned {
                    install_pip_toolchain(env)
                } else {
                    install_pip_nvshmem(env, release)
                };
                installed
                    .map_err(|e| e.to_string())
                    .and_then(|()| locate_nvshmem_release(env, release).map_err(|s| s.join("; ")))
                    .map_err(|e| Error::NvshmemNotFound {
                        searched,
                        install_error: Some(e),
                    })?
            }
        };
        Self::at_root(&root)
    }

    /// The install at `root`, its device library hashed.
    fn at_root(root: &Path) -> Result<Nvshmem> {
        let (include, lib) = nvshmem_at(root).ok_or_else(|| Error::NvshmemNotFound {
            searched: vec![root.display().to_string()],
            install_error: None,
        })?;
        let device_lib_sha256 = util::sha256_file(&lib.join("libnvshmem_device.a"))?;
        Ok(Nvshmem {
            include,
            lib,
            device_lib_sha256,
        })
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::util::TempDir;
    use sha2::Digest as _;

    fn env(t: &TempDir, cuda_home: Option<&str>, path_dirs: &[&str]) -> ToolchainEnv {
        ToolchainEnv {
            cuda_home: cuda_home.map(|h| t.path().join(h)),
            nvshmem_home: None,
            path: Some(
                std::env::join_paths(path_dirs.iter().map(|d| t.path().join(d))).expect("join"),
            ),
            pip_root: t.path().join("ws/target/cuda-toolchain"),
            python: "python3".into(),
        }
    }

    const FAKE_NVCC: &str = "echo 'nvcc: NVIDIA (R) Cuda compiler driver'; \
        echo 'Cuda compilation tools, release 13.0, V13.0.88'; \
        echo 'Build cuda_13.0.r13.0/compiler.36424714_0'";

    #[test]
    fn cuda_home_wins_over_path_and_pip() {
        let t = TempDir::new("disc1");
        let home = t.write_script("cuda/bin/nvcc", FAKE_NVCC);
        t.write_script("bin/nvcc", FAKE_NVCC);
        t.write_script("ws/target/cuda-toolchain/nvidia/cu13/bin/nvcc", FAKE_NVCC);
        let e = env(&t, Some("cuda"), &["bin"]);
        assert_eq!(locate_nvcc(&e), Ok((home, NvccOrigin::CudaHome)));
    }

    #[test]
    fn path_is_second_then_pip_third() {
        let t = TempDir::new("disc2");
        let on_path = t.write_script("bin/nvcc", FAKE_NVCC);
        let pip = t.write_script("ws/target/cuda-toolchain/nvidia/cu13/bin/nvcc", FAKE_NVCC);
        // CUDA_HOME set but without nvcc: falls through to PATH.
        let e = env(&t, Some("empty-cuda"), &["nothing", "bin"]);
        assert_eq!(locate_nvcc(&e), Ok((on_path, NvccOrigin::Path)));
        let e = env(&t, None, &["nothing"]);
        assert_eq!(locate_nvcc(&e), Ok((pip, NvccOrigin::Pip)));
    }

    #[test]
    fn not_found_lists_every_place_searched() {
        let t = TempDir::new("disc3");
        let e = env(&t, Some("cuda"), &["bin"]);
        let searched = locate_nvcc(&e).expect_err("nothing installed");
        assert_eq!(searched.len(), 3, "{searched:?}");
        assert!(
            searched[0].starts_with("$CUDA_HOME/bin/nvcc = "),
            "{searched:?}"
        );
        assert!(searched[1].starts_with("nvcc on PATH ("), "{searched:?}");
        assert!(
            searched[2].contains("cuda-toolchain/nvidia/cu13/bin/nvcc"),
            "{searched:?}"
        );
        let err = Toolchain::resolve(&e, false).expect_err("no install allowed");
        assert!(
            matches!(
                err,
                Error::NvccNotFound {
                    install_error: None,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn failed_install_is_reported_with_the_search_list() {
        let t = TempDir::new("disc4");
        let mut e = env(&t, None, &["bin"]);
        e.python = t
            .write_script("bin/fake-python", "echo 'no network' >&2; exit 1")
            .into();
        let err = Toolchain::resolve(&e, true).expect_err("install fails");
        let msg = err.to_string();
        assert!(msg.contains("CUDA_HOME is not set"), "{msg}");
        assert!(msg.contains("fake-python -m pip install"), "{msg}");
        assert!(msg.contains("exit status: 1"), "{msg}");
    }

    #[test]
    fn resolve_reads_version_and_rejects_cuda_11() {
        let t = TempDir::new("disc5");
        t.write_script("bin/nvcc", FAKE_NVCC);
        let tc = Toolchain::resolve(&env(&t, None, &["bin"]), false).expect("resolve");
        assert_eq!(tc.version.number, (13, 0, 88));
        assert_eq!(tc.origin, NvccOrigin::Path);
        t.write_script(
            "old/nvcc",
            "echo 'Cuda compilation tools, release 11.8, V11.8.89'",
        );
        let err = Toolchain::resolve(&env(&t, None, &["old"]), false).expect_err("too old");
        assert!(err.to_string().contains("CUDA 11.8.89"), "{err}");
        t.write_script("junk/nvcc", "echo hello");
        let err = Toolchain::resolve(&env(&t, None, &["junk"]), false).expect_err("junk");
        assert!(
            matches!(err, Error::NvccVersionUnrecognised { .. }),
            "{err}"
        );
    }

    #[test]
    fn parses_real_nvcc_output() {
        let v = parse_nvcc_version(
            "nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n\
             Built on Wed_Aug_20_01:58:59_PM_PDT_2025\nCuda compilation tools, release 13.0, V13.0.88\n\
             Build cuda_13.0.r13.0/compiler.36424714_0\n",
        )
        .expect("parses");
        assert_eq!(v.number, (13, 0, 88));
        assert_eq!(
            v.text,
            "Cuda compilation tools, release 13.0, V13.0.88; Build cuda_13.0.r13.0/compiler.36424714_0"
        );
        assert_eq!(parse_nvcc_version("release 13.0, Vx.y"), None);
    }

    #[test]
    fn each_release_from_nvshmem_home_the_pinned_toolchain_or_its_own_target() {
        let t = TempDir::new("shmem");
        let mut e = env(&t, None, &[]);
        let install = |root: &str, release: (u32, u32, u32), lib: &str| {
            t.write(&format!("{root}/include/nvshmem.h"), "");
            t.write(
                &format!("{root}/include/non_abi/nvshmem_version.h"),
                &format!(
                    "#pragma once\n#define NVSHMEM_VENDOR_MAJOR_VERSION {}\n\
                     #define NVSHMEM_VENDOR_MINOR_VERSION {}\n#define NVSHMEM_VENDOR_PATCH_VERSION {}\n",
                    release.0, release.1, release.2
                ),
            );
            t.write(&format!("{root}/lib/libnvshmem_device.a"), lib);
        };
        assert_eq!(
            locate_nvshmem_release(&e, "3.4.5").expect_err("none").len(),
            2
        );
        install("ws/target/cuda-toolchain/nvidia/nvshmem", (3, 4, 5), "a");
        assert_eq!(
            nvshmem_release_at(&pip_nvshmem(&e.pip_root)).as_deref(),
            Some("3.4.5")
        );
        assert_eq!(
            locate_nvshmem_release(&e, "3.4.5"),
            Ok(pip_nvshmem(&e.pip_root))
        );
        // Another release is not the pinned toolchain's: its own target, named when missing.
        let missing = locate_nvshmem_release(&e, "3.7.2").expect_err("3.7.2 missing");
        assert!(
            missing[0].contains("NVSHMEM 3.4.5, not 3.7.2"),
            "{missing:?}"
        );
        install(
            "ws/target/cuda-toolchain/nvshmem-3.7.2/nvidia/nvshmem",
            (3, 7, 2),
            "c",
        );
        assert_eq!(
            locate_nvshmem_release(&e, "3.7.2"),
            Ok(pip_nvshmem_release(&e.pip_root, "3.7.2"))
        );
        // $NVSHMEM_HOME serves the release it is, and only that one.
        install("mine", (3, 4, 5), "b");
        e.nvshmem_home = Some(t.path().join("mine"));
        assert_eq!(
            locate_nvshmem_release(&e, "3.4.5"),
            Ok(t.path().join("mine"))
        );
        let n = Nvshmem::resolve_release(&e, "3.4.5", false).expect("resolve");
        assert_eq!(n.device_lib_sha256, util::hex(&sha2::Sha256::digest(b"b")));
        let n = Nvshmem::resolve_release(&e, "3.7.2", false).expect("resolve 3.7.2");
        assert_eq!(n.device_lib_sha256, util::hex(&sha2::Sha256::digest(b"c")));
        assert!(Nvshmem::resolve_release(&e, "3.6.5", false).is_err());
    }
}
