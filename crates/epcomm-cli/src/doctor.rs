//! `epcomm doctor`: what this machine offers epcomm, and a verdict per transport.
//!
//! Sources: the CUDA driver API (through [`crate::gpu`]), `nvshmem_sys::loader` for NVSHMEM,
//! `dlopen` probes by soname for NCCL and libibverbs, `/sys/class/infiniband` for RDMA ports,
//! the environment, and `nvidia-smi topo -m` when that tool is on `PATH` (extra detail only;
//! nothing is decided from it).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use epcomm_backends::{KernelFamily, Route, TransportSpec};
use epcomm_kernels::KernelVariant;

use crate::gpu::{self, DriverFacts, GpuInfo, NoDriver, PeerLink};

/// The driver section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriverReport {
    /// Whether the driver library loads.
    pub present: bool,
    /// CUDA version the driver supports (`13.0`), when it initialised.
    pub cuda_version: Option<String>,
    /// Why it cannot be used, when it cannot.
    pub error: Option<String>,
}

/// A shared library probe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LibraryReport {
    /// What was looked for (soname).
    pub library: String,
    /// Whether it loaded.
    pub found: bool,
    /// The file it was loaded from.
    pub path: Option<String>,
    /// Its version, when it tells.
    pub version: Option<String>,
    /// Where it was looked for / why it failed / how to point at it.
    pub detail: Option<String>,
}

/// One port of an RDMA device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RdmaPort {
    /// Port number.
    pub port: u32,
    /// `state` (e.g. `4: ACTIVE`).
    pub state: Option<String>,
    /// `phys_state` (e.g. `5: LinkUp`).
    pub phys_state: Option<String>,
    /// `link_layer` (`InfiniBand` or `Ethernet`).
    pub link_layer: Option<String>,
    /// `rate` (e.g. `400 Gb/sec (4X NDR)`).
    pub rate: Option<String>,
    /// Non-zero GIDs as `index: gid (type)`, at most [`MAX_GIDS`].
    pub gids: Vec<String>,
    /// Non-zero GIDs in all.
    pub gid_count: usize,
}

/// GIDs listed per port.
pub const MAX_GIDS: usize = 16;

/// One RDMA device under `/sys/class/infiniband`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// Firmware version.
    pub fw_ver: Option<String>,
    /// Ports.
    pub ports: Vec<RdmaPort>,
}

/// A transport's verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The backend's spec (`ipc`, `nvshmem`).
    pub transport: String,
    /// Whether `epcomm bench --transport <it>` can run here.
    pub usable: bool,
    /// Why (or why not).
    pub reason: String,
    /// How to fix it, when not usable (or a caution when usable).
    pub fix: Option<String>,
}

/// One kernel image of the manifest, and where it comes from here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelImage {
    /// Its name in the manifest (`intranode`).
    pub name: String,
    /// The artifact's file name.
    pub artifact: String,
    /// Whether a Buffer can load it.
    pub available: bool,
    /// `embedded`, the file under `$EPCOMM_KERNEL_DIR`, or why it is missing.
    pub source: String,
}

impl KernelImage {
    /// Embedded at build time, else read from `dir` (`$EPCOMM_KERNEL_DIR`) at run time, as
    /// `epcomm-kernels` does when it loads the image.
    pub fn locate(name: &str, artifact: &str, embedded: bool, dir: Option<&Path>) -> Self {
        let (available, source) = if embedded {
            (true, "embedded".to_string())
        } else {
            match dir.map(|d| d.join(artifact)) {
                Some(p) if p.is_file() => (true, p.display().to_string()),
                Some(p) => (
                    false,
                    format!("not embedded, and {} does not exist", p.display()),
                ),
                None => (
                    false,
                    format!(
                        "not embedded, and {} is not set",
                        epcomm_kernels::KERNEL_DIR_ENV
                    ),
                ),
            }
        };
        Self {
            name: name.into(),
            artifact: artifact.into(),
            available,
            source,
        }
    }

    /// Every image of the kernels' manifest (`epcomm_kernels::images`), completed by
    /// `$EPCOMM_KERNEL_DIR`.
    pub fn locate_all() -> Vec<Self> {
        let dir = std::env::var_os(epcomm_kernels::KERNEL_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        epcomm_kernels::images()
            .map(|i| Self::locate(i.name(), i.artifact(), i.is_embedded(), dir.as_deref()))
            .collect()
    }

    /// The image of `family` among `images`.
    pub fn of_family(images: &[Self], family: KernelFamily) -> Option<&Self> {
        let name = kernel_image(family).name();
        images.iter().find(|i| i.name == name)
    }

    /// How to make it available.
    pub fn fix(&self) -> String {
        format!(
            "build the kernels (`cargo xtask build-kernels`) and rebuild epcomm, or set {} to a \
             directory holding {}",
            epcomm_kernels::KERNEL_DIR_ENV,
            self.artifact
        )
    }
}

/// The kernel image a transport of `family` loads (the frontend's choice of variant).
pub fn kernel_image(family: KernelFamily) -> epcomm_kernels::Image {
    match family {
        KernelFamily::NvlinkStore => KernelVariant::Store,
        KernelFamily::NvshmemDevice => KernelVariant::Nvshmem,
    }
    .image()
}

/// One spec per backend, from the library's list of spec forms (`TransportSpec::FORMS`).
pub fn backends() -> Vec<TransportSpec> {
    let mut specs: Vec<TransportSpec> = Vec::new();
    for spec in TransportSpec::FORMS
        .iter()
        .filter_map(|f| f.parse::<TransportSpec>().ok())
    {
        if !specs.iter().any(|s| s.backend() == spec.backend()) {
            specs.push(spec);
        }
    }
    specs
}

/// Everything `epcomm doctor` reports.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DoctorReport {
    /// epcomm's version.
    pub epcomm_version: String,
    /// The CUDA driver.
    pub driver: DriverReport,
    /// GPUs by ordinal.
    pub gpus: Vec<GpuInfo>,
    /// Peer access per ordered GPU pair.
    pub peer_links: Vec<PeerLink>,
    /// Why peer access could not be queried.
    pub peer_error: Option<String>,
    /// `nvidia-smi topo -m`, when the tool is present.
    pub nvidia_smi_topo: Option<String>,
    /// Every kernel image of the manifest: embedded, found, or missing.
    pub kernels: Vec<KernelImage>,
    /// The NVSHMEM host library.
    pub nvshmem: LibraryReport,
    /// NCCL.
    pub nccl: LibraryReport,
    /// libibverbs.
    pub ibverbs: LibraryReport,
    /// RDMA devices.
    pub rdma: Vec<RdmaDevice>,
    /// Relevant environment variables, sorted.
    pub env: Vec<(String, String)>,
    /// Warnings about the environment.
    pub warnings: Vec<String>,
    /// One verdict per transport.
    pub verdicts: Vec<Verdict>,
}

impl DoctorReport {
    /// `Ok` when `spec` can run here: its backend's verdict is usable and its layout fits the
    /// GPUs of this host (e.g. `vnodes=N` divides their count); else why not, as one line.
    ///
    /// # Errors
    /// The reason, prefixed with the spec.
    pub fn requirement(&self, spec: &TransportSpec) -> Result<(), String> {
        let verdict = self
            .verdicts
            .iter()
            .find(|v| v.transport == spec.backend())
            .ok_or_else(|| format!("{spec}: no verdict"))?;
        if !verdict.usable {
            return Err(format!("{spec}: {}", verdict.reason));
        }
        let n = self.gpus.len();
        spec.world_layout(n, 0, n)
            .map(drop)
            .map_err(|e| format!("{spec}: not usable on {n} GPU(s): {e}"))
    }
}

/// Runs every probe.
pub fn collect() -> DoctorReport {
    let facts = gpu::probe();
    let (driver, gpus) = match &facts {
        Ok(f) => (
            DriverReport {
                present: true,
                cuda_version: Some(f.version_string()),
                error: None,
            },
            f.gpus.clone(),
        ),
        Err(e) => (
            DriverReport {
                present: !matches!(e, NoDriver::Missing),
                cuda_version: None,
                error: Some(e.to_string()),
            },
            Vec::new(),
        ),
    };
    let links = match &facts {
        Ok(f) if f.gpus.len() > 1 => gpu::peer_links(&f.gpus),
        _ => Ok(Vec::new()),
    };
    let nvidia_smi_topo = match &facts {
        Ok(f) if f.gpus.len() > 1 => nvidia_smi_topo(),
        _ => None,
    };
    let kernels = KernelImage::locate_all();
    let nvshmem = probe_nvshmem();
    let env = relevant_env(std::env::vars_os().map(|(k, v)| {
        (
            k.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    }));
    let mut warnings = env_warnings(&env);
    if let Ok(l) = &links {
        warnings.extend(link_warnings(l));
    }
    let verdicts = verdicts(&facts, &links, &kernels, &nvshmem);
    DoctorReport {
        epcomm_version: env!("CARGO_PKG_VERSION").into(),
        driver,
        gpus,
        peer_links: links.as_ref().cloned().unwrap_or_default(),
        peer_error: links.err(),
        nvidia_smi_topo,
        kernels,
        nvshmem,
        nccl: probe_library(&["libnccl.so.2", "libnccl.so"], LibKind::Nccl),
        ibverbs: probe_library(&["libibverbs.so.1", "libibverbs.so"], LibKind::Plain),
        rdma: rdma_devices(Path::new("/sys/class/infiniband")),
        env,
        warnings,
        verdicts,
    }
}

/// The verdicts, one per backend ([`backends`]), from the probes' results (pure).
pub fn verdicts(
    facts: &Result<DriverFacts, NoDriver>,
    links: &Result<Vec<PeerLink>, String>,
    kernels: &[KernelImage],
    nvshmem: &LibraryReport,
) -> Vec<Verdict> {
    backends()
        .into_iter()
        .map(|spec| {
            let (usable, reason, fix) = match verdict(&spec, facts, links, kernels, nvshmem) {
                Ok((reason, note)) => (true, format!("usable: {reason}"), note),
                Err((reason, fix)) => (false, format!("not usable: {reason}"), Some(fix)),
            };
            Verdict {
                transport: spec.to_string(),
                usable,
                reason,
                fix,
            }
        })
        .collect()
}

/// `Ok((why, note))` when `spec` can run here, else `Err((why not, fix))`. What is required
/// follows from the library's description of the backend: compiled in, the kernel image of
/// its kernel family, its run-time library, and, for a backend that reaches peers by stores
/// only, P2P between every pair of GPUs.
fn verdict(
    spec: &TransportSpec,
    facts: &Result<DriverFacts, NoDriver>,
    links: &Result<Vec<PeerLink>, String>,
    kernels: &[KernelImage],
    nvshmem: &LibraryReport,
) -> Result<(String, Option<String>), (String, String)> {
    let caps = spec.capabilities().map_err(|e| {
        (
            format!("{spec} is not compiled into this build"),
            format!("{e}"),
        )
    })?;
    let facts = facts.as_ref().map_err(|e| (e.short(), driver_fix(e)))?;
    if spec.needs_runtime_library() && !nvshmem.found {
        return Err((
            "the NVSHMEM host library does not load".into(),
            nvshmem
                .detail
                .clone()
                .unwrap_or_else(|| "set EPCOMM_NVSHMEM_LIB to the library's directory".into()),
        ));
    }
    let image = KernelImage::of_family(kernels, caps.kernel_family).ok_or_else(|| {
        (
            format!("no kernel image for {:?} in this build", caps.kernel_family),
            "rebuild epcomm with the kernels (`cargo xtask build-kernels`)".to_string(),
        )
    })?;
    if !image.available {
        return Err((
            format!("no kernel image {} ({})", image.artifact, image.source),
            image.fix(),
        ));
    }
    let n = facts.gpus.len();
    if spec.needs_runtime_library() {
        return Ok((
            format!(
                "NVSHMEM {} from {}",
                nvshmem.version.as_deref().unwrap_or("?"),
                nvshmem.path.as_deref().unwrap_or("?")
            ),
            None,
        ));
    }
    if caps.routes.contains(&Route::PutSignal) || n == 1 {
        return Ok((format!("{n} GPU(s)"), None));
    }
    // Stores only: every pair of GPUs must map each other.
    let l = links.as_ref().map_err(|e| {
        (
            format!("peer access could not be queried ({e})"),
            "check the driver with `nvidia-smi`".to_string(),
        )
    })?;
    let missing: Vec<String> = l
        .iter()
        .filter(|p| !p.can_access_peer)
        .map(|p| format!("{}->{}", p.from, p.to))
        .collect();
    if !missing.is_empty() {
        return Err((
            format!("no P2P access between GPUs {}", missing.join(", ")),
            format!(
                "{spec} needs P2P (NVLink) between every pair of GPUs it uses: pick GPUs that \
                 have it with CUDA_VISIBLE_DEVICES and --world, or check the NVLink / PCIe \
                 (IOMMU, ACS) setup"
            ),
        ));
    }
    let nvlink = l.iter().filter(|p| p.kind() == "NVLink").count();
    Ok((
        format!(
            "{n} GPUs, P2P between every pair (native atomics, i.e. NVLink, on {nvlink} of {} \
             directed pairs)",
            l.len()
        ),
        (nvlink < l.len()).then(|| {
            "some pairs lack native peer atomics (PCIe, not NVLink); the kernels' peer atomics \
             expect NVLink"
                .to_string()
        }),
    ))
}

fn driver_fix(e: &NoDriver) -> String {
    match e {
        NoDriver::Missing => {
            "install the NVIDIA driver (libcuda.so.1 must be loadable); in a container, start it \
             with the GPU runtime enabled"
        }
        NoDriver::Init(_) => {
            "check that the driver loads (`nvidia-smi`) and that the kernel module matches the \
             user-space driver"
        }
        NoDriver::NoDevice => {
            "check CUDA_VISIBLE_DEVICES (unset it to see every GPU) and the GPUs' state"
        }
    }
    .into()
}

/// The variables that matter to epcomm, NVSHMEM, NCCL and CUDA, sorted by name.
pub fn relevant_env(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    const EXACT: [&str; 3] = [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "LD_LIBRARY_PATH",
    ];
    const PREFIXES: [&str; 3] = ["EPCOMM_", "NVSHMEM_", "NCCL_"];
    let mut v: Vec<(String, String)> = vars
        .filter(|(k, _)| EXACT.contains(&k.as_str()) || PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    v.sort();
    v
}

/// Warnings about the environment (pure).
pub fn env_warnings(env: &[(String, String)]) -> Vec<String> {
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut w = Vec::new();
    let shown = |v: Option<&str>| match v {
        None => "unset".to_string(),
        Some(v) => format!("{v:?}"),
    };
    let nvls = get("NVSHMEM_DISABLE_NVLS");
    if nvls != Some("1") {
        w.push(format!(
            "NVSHMEM_DISABLE_NVLS is {}: NVSHMEM may use NVLink multicast (NVLS), which can take a \
             shared host down; export NVSHMEM_DISABLE_NVLS=1 (`epcomm bench` sets it for its own \
             workers)",
            shown(nvls)
        ));
    }
    let nccl = get("NCCL_NVLS_ENABLE");
    if nccl != Some("0") {
        w.push(format!(
            "NCCL_NVLS_ENABLE is {}: NCCL may use NVLink multicast (NVLS); export \
             NCCL_NVLS_ENABLE=0",
            shown(nccl)
        ));
    }
    if get("CUDA_VISIBLE_DEVICES") == Some("") {
        w.push("CUDA_VISIBLE_DEVICES is set but empty: it hides every GPU".into());
    }
    if get(epcomm_check::procs::WORKER_ENV).is_some() {
        w.push(format!(
            "{} is set: it makes `epcomm bench` act as one of its own workers; unset it",
            epcomm_check::procs::WORKER_ENV
        ));
    }
    w
}

fn link_warnings(links: &[PeerLink]) -> Vec<String> {
    links
        .iter()
        .filter(|l| l.can_access_peer && l.native_atomics == Some(false))
        .map(|l| {
            format!(
                "GPU {} -> GPU {}: P2P without native atomics (PCIe, not NVLink)",
                l.from, l.to
            )
        })
        .collect()
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn sorted_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(String, PathBuf)> = rd
        .filter_map(Result::ok)
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    // Numeric names in numeric order, the rest by name.
    v.sort_by(|a, b| match (a.0.parse::<u64>(), b.0.parse::<u64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        _ => a.0.cmp(&b.0),
    });
    v
}

/// The RDMA devices under `root` (normally `/sys/class/infiniband`); empty when absent.
pub fn rdma_devices(root: &Path) -> Vec<RdmaDevice> {
    sorted_entries(root)
        .into_iter()
        .map(|(name, dev)| {
            let ports = sorted_entries(&dev.join("ports"))
                .into_iter()
                .filter_map(|(p, dir)| {
                    let port = p.parse().ok()?;
                    let mut gids = Vec::new();
                    let mut gid_count = 0;
                    for (i, gid_path) in sorted_entries(&dir.join("gids")) {
                        let Some(gid) = read_trim(&gid_path) else {
                            continue;
                        };
                        if gid.chars().all(|c| c == '0' || c == ':') {
                            continue;
                        }
                        gid_count += 1;
                        if gids.len() < MAX_GIDS {
                            let kind = read_trim(&dir.join("gid_attrs/types").join(&i));
                            let netdev = read_trim(&dir.join("gid_attrs/ndevs").join(&i));
                            let mut s = format!("{i}: {gid}");
                            if let Some(k) = kind {
                                let _ = write!(s, " ({k})");
                            }
                            if let Some(n) = netdev {
                                let _ = write!(s, " on {n}");
                            }
                            gids.push(s);
                        }
                    }
                    Some(RdmaPort {
                        port,
                        state: read_trim(&dir.join("state")),
                        phys_state: read_trim(&dir.join("phys_state")),
                        link_layer: read_trim(&dir.join("link_layer")),
                        rate: read_trim(&dir.join("rate")),
                        gids,
                        gid_count,
                    })
                })
                .collect();
            RdmaDevice {
                fw_ver: read_trim(&dev.join("fw_ver")),
                name,
                ports,
            }
        })
        .collect()
}

/// The file backing the first mapping whose file name starts with `stem` in a
/// `/proc/self/maps` text.
pub fn find_in_maps(maps: &str, stem: &str) -> Option<String> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(stem))
        })
        .map(str::to_string)
}

fn loaded_path(stem: &str) -> Option<String> {
    std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|m| find_in_maps(&m, stem))
}

/// `stem` of a soname: `libnccl.so.2` → `libnccl.so`.
fn stem(soname: &str) -> &str {
    soname
        .find(".so")
        .map_or(soname, |i| &soname[..i + ".so".len()])
}

fn probe_nvshmem() -> LibraryReport {
    use nvshmem_sys::loader;
    let how = format!(
        "searched: ${} (directory or file), $NVSHMEM_HOME/lib, pip installs \
         (nvidia/nvshmem/lib under site-/dist-packages), then the dynamic loader's path; set {} \
         to the directory holding {} to choose one",
        loader::ENV_EPCOMM_NVSHMEM_LIB,
        loader::ENV_EPCOMM_NVSHMEM_LIB,
        loader::LIBRARY_NAME
    );
    match loader::load_default() {
        Ok(lib) => {
            let mut path = lib.path().display().to_string();
            if !path.contains('/') {
                path = loaded_path(stem(loader::LIBRARY_NAME)).unwrap_or(path);
            }
            LibraryReport {
                library: loader::LIBRARY_NAME.into(),
                found: true,
                path: Some(path),
                version: Some(lib.version().to_string()),
                detail: Some(how),
            }
        }
        Err(e) => LibraryReport {
            library: loader::LIBRARY_NAME.into(),
            found: false,
            path: None,
            version: None,
            detail: Some(e.to_string()),
        },
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LibKind {
    Nccl,
    Plain,
}

/// NCCL's `ncclGetVersion` code: `major * 10000 + minor * 100 + patch` since 2.9, before that
/// `major * 1000 + minor * 100 + patch`.
pub fn nccl_version(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100)
    }
}

fn probe_library(sonames: &[&str], kind: LibKind) -> LibraryReport {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    let mut errors = Vec::new();
    for name in sonames {
        // SAFETY: dlopen runs the library's initialisers; NCCL's and libibverbs' only set up
        // internal state. RTLD_LOCAL keeps their symbols out of the global namespace.
        let lib = match unsafe { Library::open(Some(*name), RTLD_NOW | RTLD_LOCAL) } {
            Ok(l) => l,
            Err(e) => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                errors.push(why);
                continue;
            }
        };
        let version = match kind {
            LibKind::Nccl => {
                // SAFETY: `ncclGetVersion` has this C signature in every NCCL 2.x release.
                let f = unsafe {
                    lib.get::<unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int>(
                        b"ncclGetVersion\0",
                    )
                };
                f.ok().and_then(|f| {
                    let mut code = 0;
                    // SAFETY: writes one int through a pointer to a live local; needs no
                    // initialised communicator.
                    (unsafe { f(&mut code) } == 0).then(|| nccl_version(code))
                })
            }
            LibKind::Plain => None,
        };
        let path = loaded_path(stem(name)).or_else(|| Some(name.to_string()));
        drop(lib);
        return LibraryReport {
            library: sonames[0].into(),
            found: true,
            path,
            version,
            detail: None,
        };
    }
    LibraryReport {
        library: sonames[0].into(),
        found: false,
        path: None,
        version: None,
        detail: Some(format!(
            "not loadable ({}); if it is installed, add its directory to LD_LIBRARY_PATH",
            errors.join("; ")
        )),
    }
}

fn nvidia_smi_topo() -> Option<String> {
    let mut child = Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if start.elapsed() > Duration::from_secs(10) => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let mut out = String::new();
    use std::io::Read as _;
    child.stdout.take()?.read_to_string(&mut out).ok()?;
    Some(out.trim_end().to_string()).filter(|s| !s.is_empty())
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn lib_line(s: &mut String, what: &str, l: &LibraryReport) {
    if l.found {
        let _ = writeln!(
            s,
            "  {what:<9} found: {}{}",
            l.path.as_deref().unwrap_or(&l.library),
            l.version
                .as_deref()
                .map(|v| format!(" (version {v})"))
                .unwrap_or_default()
        );
    } else {
        let _ = writeln!(s, "  {what:<9} not found ({})", l.library);
        if let Some(d) = &l.detail {
            for line in d.lines() {
                let _ = writeln!(s, "            {line}");
            }
        }
    }
}

/// The human-readable report.
pub fn render(r: &DoctorReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "epcomm doctor (epcomm {})", r.epcomm_version);
    let _ = writeln!(s, "\nCUDA driver");
    match (&r.driver.cuda_version, &r.driver.error) {
        (Some(v), _) => {
            let _ = writeln!(s, "  loaded; supports CUDA {v}");
        }
        (None, Some(e)) => {
            let _ = writeln!(s, "  {e}");
        }
        (None, None) => {
            let _ = writeln!(s, "  unknown");
        }
    }
    let _ = writeln!(s, "\nGPUs");
    if r.gpus.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for g in &r.gpus {
        let _ = writeln!(
            s,
            "  {}: {}, {} SMs, {}, compute capability {}.{}{}",
            g.ordinal,
            g.name,
            g.sms,
            gib(g.memory_bytes),
            g.compute_capability.0,
            g.compute_capability.1,
            g.pci_bus_id
                .as_deref()
                .map(|b| format!(", PCI {b}"))
                .unwrap_or_default()
        );
    }
    if r.gpus.len() > 1 {
        let _ = writeln!(
            s,
            "\nPeer access (cuDeviceCanAccessPeer; NVLink = native peer atomics per \
             cuDeviceGetP2PAttribute)"
        );
        if let Some(e) = &r.peer_error {
            let _ = writeln!(s, "  could not be queried: {e}");
        }
        let n = r.gpus.len();
        let _ = write!(s, "  {:>6}", "");
        for j in 0..n {
            let _ = write!(s, " {:>9}", format!("GPU{j}"));
        }
        let _ = writeln!(s);
        for i in 0..n {
            let _ = write!(s, "  {:>6}", format!("GPU{i}"));
            for j in 0..n {
                let cell = if i == j {
                    "-"
                } else {
                    r.peer_links
                        .iter()
                        .find(|l| l.from == i && l.to == j)
                        .map_or("?", PeerLink::kind)
                };
                let _ = write!(s, " {cell:>9}");
            }
            let _ = writeln!(s);
        }
    }
    if let Some(t) = &r.nvidia_smi_topo {
        let _ = writeln!(s, "\nnvidia-smi topo -m");
        for line in t.lines() {
            let _ = writeln!(s, "  {line}");
        }
    }
    let _ = writeln!(s, "\nKernel images");
    for k in &r.kernels {
        let _ = writeln!(s, "  {:<18} {}: {}", k.name, k.artifact, k.source);
    }
    let _ = writeln!(s, "\nLibraries");
    lib_line(&mut s, "NVSHMEM", &r.nvshmem);
    lib_line(&mut s, "NCCL", &r.nccl);
    lib_line(&mut s, "ibverbs", &r.ibverbs);
    let _ = writeln!(s, "\nRDMA devices (/sys/class/infiniband)");
    if r.rdma.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for d in &r.rdma {
        let _ = writeln!(
            s,
            "  {}{}",
            d.name,
            d.fw_ver
                .as_deref()
                .map(|f| format!(" (firmware {f})"))
                .unwrap_or_default()
        );
        for p in &d.ports {
            let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "?".into());
            let _ = writeln!(
                s,
                "    port {}: {}, {}, {}, {}",
                p.port,
                o(&p.state),
                o(&p.phys_state),
                o(&p.link_layer),
                o(&p.rate)
            );
            for g in &p.gids {
                let _ = writeln!(s, "      gid {g}");
            }
            if p.gid_count > p.gids.len() {
                let _ = writeln!(s, "      ... {} more", p.gid_count - p.gids.len());
            }
        }
    }
    let _ = writeln!(s, "\nEnvironment");
    if r.env.is_empty() {
        let _ = writeln!(
            s,
            "  (no EPCOMM_*, NVSHMEM_*, NCCL_*, CUDA_* variables set)"
        );
    }
    for (k, v) in &r.env {
        let _ = writeln!(s, "  {k}={v}");
    }
    if !r.warnings.is_empty() {
        let _ = writeln!(s, "\nWarnings");
        for w in &r.warnings {
            let _ = writeln!(s, "  ! {w}");
        }
    }
    let _ = writeln!(s, "\nVerdicts");
    for v in &r.verdicts {
        let _ = writeln!(s, "  {:<8} {}", v.transport, v.reason);
        if let Some(f) = &v.fix {
            let label = if v.usable { "note" } else { "fix" };
            let mut lines = f.lines();
            if let Some(first) = lines.next() {
                let _ = writeln!(s, "  {:<8} {label}: {first}", "");
            }
            for line in lines {
                let _ = writeln!(s, "  {:<8}   {line}", "");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: usize) -> GpuInfo {
        GpuInfo {
            ordinal: i,
            name: "GPU".into(),
            sms: 132,
            memory_bytes: 80 << 30,
            compute_capability: (9, 0),
            pci_bus_id: None,
        }
    }

    fn link(from: usize, to: usize, p2p: bool) -> PeerLink {
        PeerLink {
            from,
            to,
            can_access_peer: p2p,
            native_atomics: Some(p2p),
            performance_rank: Some(0),
        }
    }

    fn lib(found: bool) -> LibraryReport {
        LibraryReport {
            library: "libnvshmem_host.so.3".into(),
            found,
            path: found.then(|| "/x/libnvshmem_host.so.3".into()),
            version: found.then(|| "3.4.5".into()),
            detail: (!found).then(|| "set EPCOMM_NVSHMEM_LIB".into()),
        }
    }

    fn images(available: bool) -> Vec<KernelImage> {
        let dir = (!available).then(|| Path::new("/nonexistent-epcomm"));
        epcomm_kernels::images()
            .map(|i| KernelImage::locate(i.name(), i.artifact(), available, dir))
            .collect()
    }

    #[test]
    fn no_driver_means_nothing_is_usable() {
        let v = verdicts(
            &Err(NoDriver::Missing),
            &Ok(vec![]),
            &images(true),
            &lib(true),
        );
        assert_eq!(v.len(), 2);
        for v in v {
            assert!(!v.usable);
            assert_eq!(v.reason, "not usable: no CUDA driver");
            assert!(v.fix.is_some());
        }
    }

    #[test]
    fn ipc_needs_p2p_between_every_pair() {
        let facts = Ok(DriverFacts {
            version: 13000,
            gpus: vec![gpu(0), gpu(1)],
        });
        let ok = vec![link(0, 1, true), link(1, 0, true)];
        let v = verdicts(&facts, &Ok(ok), &images(true), &lib(false));
        assert!(v[0].usable, "{v:?}");
        assert!(!v[1].usable);
        assert!(v[1].fix.as_deref().unwrap().contains("EPCOMM_NVSHMEM_LIB"));
        let bad = vec![link(0, 1, true), link(1, 0, false)];
        let v = verdicts(&facts, &Ok(bad), &images(true), &lib(true));
        assert!(!v[0].usable);
        assert!(v[0].reason.contains("1->0"), "{}", v[0].reason);
        assert!(v[1].usable);
        let single = Ok(DriverFacts {
            version: 13000,
            gpus: vec![gpu(0)],
        });
        assert!(verdicts(&single, &Ok(vec![]), &images(true), &lib(true))[0].usable);
        let v = verdicts(&single, &Ok(vec![]), &images(false), &lib(true));
        assert!(
            v.iter()
                .all(|v| !v.usable && v.fix.as_deref().unwrap().contains("xtask"))
        );
        assert!(
            v[0].reason.contains("/nonexistent-epcomm/intranode.fatbin"),
            "{v:?}"
        );
        let k = KernelImage::locate("a", "a.bin", false, None);
        assert!(
            !k.available && k.source.contains("EPCOMM_KERNEL_DIR"),
            "{k:?}"
        );
        assert!(k.fix().contains("EPCOMM_KERNEL_DIR"));
    }

    #[test]
    fn nvls_warnings() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let w = env_warnings(&env(&[]));
        assert!(
            w.iter()
                .any(|w| w.starts_with("NVSHMEM_DISABLE_NVLS is unset"))
        );
        assert!(w.iter().any(|w| w.starts_with("NCCL_NVLS_ENABLE is unset")));
        let w = env_warnings(&env(&[
            ("NVSHMEM_DISABLE_NVLS", "1"),
            ("NCCL_NVLS_ENABLE", "0"),
        ]));
        assert!(w.is_empty(), "{w:?}");
        let w = env_warnings(&env(&[
            ("NVSHMEM_DISABLE_NVLS", "0"),
            ("NCCL_NVLS_ENABLE", "1"),
            ("CUDA_VISIBLE_DEVICES", ""),
        ]));
        assert_eq!(w.len(), 3, "{w:?}");
        let picked = relevant_env(
            env(&[
                ("PATH", "/bin"),
                ("NCCL_DEBUG", "INFO"),
                ("EPCOMM_X", "1"),
                ("CUDA_VISIBLE_DEVICES", "0,1"),
                ("LD_LIBRARY_PATH", "/l"),
                ("HOME", "/h"),
            ])
            .into_iter(),
        );
        let names: Vec<&str> = picked.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "CUDA_VISIBLE_DEVICES",
                "EPCOMM_X",
                "LD_LIBRARY_PATH",
                "NCCL_DEBUG"
            ]
        );
    }

    #[test]
    fn rdma_from_a_fake_sysfs() {
        let root = std::env::temp_dir().join(format!("epcomm-cli-ib-{}", std::process::id()));
        let port = root.join("mlx5_0/ports/1");
        for d in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(port.join(d)).unwrap();
        }
        let w = |p: &str, v: &str| std::fs::write(port.join(p), v).unwrap();
        std::fs::write(root.join("mlx5_0/fw_ver"), "28.39.1002\n").unwrap();
        w("state", "4: ACTIVE\n");
        w("phys_state", "5: LinkUp\n");
        w("link_layer", "Ethernet\n");
        w("rate", "400 Gb/sec (4X NDR)\n");
        w("gids/0", "fe80:0000:0000:0000:0a00:00ff:fe00:0001\n");
        w("gids/1", "0000:0000:0000:0000:0000:0000:0000:0000\n");
        w("gid_attrs/types/0", "RoCE v2\n");
        w("gid_attrs/ndevs/0", "eth0\n");
        let devs = rdma_devices(&root);
        assert_eq!(devs.len(), 1);
        let d = &devs[0];
        assert_eq!(d.name, "mlx5_0");
        assert_eq!(d.fw_ver.as_deref(), Some("28.39.1002"));
        let p = &d.ports[0];
        assert_eq!(p.port, 1);
        assert_eq!(p.state.as_deref(), Some("4: ACTIVE"));
        assert_eq!(p.gid_count, 1);
        assert_eq!(
            p.gids,
            ["0: fe80:0000:0000:0000:0a00:00ff:fe00:0001 (RoCE v2) on eth0"]
        );
        assert!(rdma_devices(&root.join("absent")).is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn maps_and_versions() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3\n\
                    7f02-7f03 r--p 00000000 00:00 0 [heap]\n";
        assert_eq!(
            find_in_maps(maps, "libnccl.so").as_deref(),
            Some("/usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3")
        );
        assert_eq!(find_in_maps(maps, "libibverbs.so"), None);
        assert_eq!(stem("libnccl.so.2"), "libnccl.so");
        assert_eq!(nccl_version(22703), "2.27.3");
        assert_eq!(nccl_version(2804), "2.8.4");
    }

    #[test]
    fn report_renders_without_a_driver() {
        let r = DoctorReport {
            epcomm_version: "0".into(),
            driver: DriverReport {
                present: false,
                cuda_version: None,
                error: Some(NoDriver::Missing.to_string()),
            },
            gpus: vec![],
            peer_links: vec![],
            peer_error: None,
            nvidia_smi_topo: None,
            kernels: images(true),
            nvshmem: lib(false),
            nccl: lib(false),
            ibverbs: lib(false),
            rdma: vec![],
            env: vec![],
            warnings: env_warnings(&[]),
            verdicts: verdicts(
                &Err(NoDriver::Missing),
                &Ok(vec![]),
                &images(true),
                &lib(false),
            ),
        };
        let text = render(&r);
        assert!(text.contains("no CUDA driver"), "{text}");
        for spec in backends() {
            let line = format!("{:<8} not usable: no CUDA driver", spec.to_string());
            assert!(text.contains(&line), "{line}: {text}");
            let err = r.requirement(&spec).unwrap_err();
            assert!(err.contains("no CUDA driver"), "{err}");
        }
        let json = serde_json::to_string(&r).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["verdicts"][0]["usable"], false);
    }
}
