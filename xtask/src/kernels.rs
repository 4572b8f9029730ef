//! `cargo xtask build-kernels`: compiles every image of the image manifest
//! (`kernels/images.txt`) into a fatbin or an NVSHMEM device-linked cubin, incrementally,
//! recording what was built in `manifest.json`.
//!
//! An artifact is rebuilt only when the SHA-256 of its inputs changes: its entry source, every
//! other file under `kernels/` except `.cu` entries and the image manifest (the headers), the
//! compiler and linker flags, the nvcc version and, for NVSHMEM images, the content of
//! `libnvshmem_device.a`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{CompileFailure, Error, Result};
use crate::toolchain::{Nvshmem, Toolchain, ToolchainEnv};
use crate::util::{self, combined_output, command_line, human_size, relative_to};

/// Version of the manifest format; a different version makes every artifact stale.
pub const MANIFEST_VERSION: u32 = 1;
/// File name of the manifest inside the output directory.
pub const MANIFEST_NAME: &str = "manifest.json";

/// Where things are: the workspace, the kernel output directory and the pip toolchain root.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Workspace root (holds `kernels/`).
    pub workspace: PathBuf,
    /// Output directory for artifacts and the manifest.
    pub out_dir: PathBuf,
    /// Root of the pinned pip toolchain.
    pub pip_root: PathBuf,
}

impl Layout {
    /// The layout of this checkout: the workspace is the parent of xtask's manifest directory,
    /// the output is `$EPCOMM_KERNEL_DIR` (relative values are taken from the workspace root)
    /// or `<workspace>/target/kernels`.
    pub fn from_env() -> Layout {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let out_dir = match std::env::var_os("EPCOMM_KERNEL_DIR").filter(|v| !v.is_empty()) {
            Some(dir) => workspace.join(dir),
            None => workspace.join("target/kernels"),
        };
        let pip_root = workspace.join("target/cuda-toolchain");
        Layout {
            workspace,
            out_dir,
            pip_root,
        }
    }

    fn kernels_dir(&self) -> PathBuf {
        self.workspace.join("kernels")
    }
}

/// How an image is built (the `build` field of the image manifest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelKind {
    /// `fatbin`: `nvcc --fatbin` (sm_90a SASS + compute_90 PTX) into a `.fatbin`.
    Fatbin,
    /// `nvshmem_cubin`: `nvcc -rdc=true -cubin`, device-linked with `libnvshmem_device` into a
    /// `.cubin`.
    NvshmemCubin,
}

impl KernelKind {
    /// The word the image manifest uses.
    pub fn word(self) -> &'static str {
        match self {
            KernelKind::Fatbin => "fatbin",
            KernelKind::NvshmemCubin => "nvshmem_cubin",
        }
    }

    /// The extension an artifact of this kind must have.
    pub fn extension(self) -> &'static str {
        match self {
            KernelKind::Fatbin => "fatbin",
            KernelKind::NvshmemCubin => "cubin",
        }
    }

    fn from_word(word: &str) -> Option<KernelKind> {
        [KernelKind::Fatbin, KernelKind::NvshmemCubin]
            .into_iter()
            .find(|k| k.word() == word)
    }
}

/// Workspace-relative path of the image manifest: one line per kernel image (see
/// [`parse_images`]). It drives `build-kernels`, `pack-device` and, through `cargo xtask
/// codegen`, the image table that `epcomm-kernels` embeds from.
pub const IMAGES_FILE: &str = "kernels/images.txt";

/// One kernel image: a line of the image manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSource {
    /// The name the Rust side uses, e.g. `intranode`.
    pub name: String,
    /// The artifact's file name in the output directory, e.g. `intranode.fatbin`.
    pub artifact: String,
    /// How it is built.
    pub kind: KernelKind,
    /// Workspace-relative path of its entry source, e.g. `kernels/intranode/store.cu`.
    pub rel: String,
}

/// A line of the image manifest that does not follow its format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImagesError {
    /// Not four fields.
    #[error("{IMAGES_FILE}:{line}: expected 4 fields (name artifact build entry), found {found}")]
    Fields {
        /// 1-based line number.
        line: usize,
        /// How many fields it has.
        found: usize,
    },
    /// A name that is not a Rust-friendly identifier.
    #[error(
        "{IMAGES_FILE}:{line}: name `{name}` must be lower-case ASCII letters, digits and `_`, starting with a letter"
    )]
    Name {
        /// 1-based line number.
        line: usize,
        /// The name.
        name: String,
    },
    /// An unknown build kind.
    #[error("{IMAGES_FILE}:{line}: unknown build `{build}` (expected fatbin or nvshmem_cubin)")]
    Build {
        /// 1-based line number.
        line: usize,
        /// The word found.
        build: String,
    },
    /// An artifact name with a path or the wrong extension for its build.
    #[error(
        "{IMAGES_FILE}:{line}: artifact `{artifact}` must be a plain file name ending in .{extension}"
    )]
    Artifact {
        /// 1-based line number.
        line: usize,
        /// The artifact name.
        artifact: String,
        /// The extension its build needs.
        extension: &'static str,
    },
    /// An entry that is not a `.cu` file under `kernels/`.
    #[error("{IMAGES_FILE}:{line}: entry `{entry}` must be a .cu file under kernels/")]
    Entry {
        /// 1-based line number.
        line: usize,
        /// The entry path.
        entry: String,
    },
    /// A name or artifact listed twice.
    #[error("{IMAGES_FILE}:{line}: {what} `{value}` is already listed")]
    Duplicate {
        /// 1-based line number.
        line: usize,
        /// `name` or `artifact`.
        what: &'static str,
        /// The repeated value.
        value: String,
    },
}

/// Parses the image manifest: `#` starts a comment, blank lines are skipped, and every other
/// line is `name artifact build entry`, separated by whitespace. Names are unique lower-case
/// identifiers, artifacts unique file names whose extension matches the build (`fatbin` →
/// `.fatbin`, `nvshmem_cubin` → `.cubin`), entries `.cu` files under `kernels/`. Images keep
/// the manifest's order.
pub fn parse_images(text: &str) -> std::result::Result<Vec<KernelSource>, ImagesError> {
    let mut images: Vec<KernelSource> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let fields: Vec<&str> = raw
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if fields.is_empty() {
            continue;
        }
        let &[name, artifact, build, entry] = fields.as_slice() else {
            return Err(ImagesError::Fields {
                line,
                found: fields.len(),
            });
        };
        let mut chars = name.chars();
        if !chars.next().is_some_and(|c| c.is_ascii_lowercase())
            || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(ImagesError::Name {
                line,
                name: name.to_string(),
            });
        }
        let kind = KernelKind::from_word(build).ok_or_else(|| ImagesError::Build {
            line,
            build: build.to_string(),
        })?;
        let extension = kind.extension();
        let stem = artifact
            .strip_suffix(extension)
            .and_then(|s| s.strip_suffix('.'));
        if artifact.contains(['/', '\\']) || stem.is_none_or(str::is_empty) {
            return Err(ImagesError::Artifact {
                line,
                artifact: artifact.to_string(),
                extension,
            });
        }
        if !entry.starts_with("kernels/") || !entry.ends_with(".cu") || entry.contains("..") {
            return Err(ImagesError::Entry {
                line,
                entry: entry.to_string(),
            });
        }
        for (what, value, taken) in [
            ("name", name, images.iter().any(|i| i.name == name)),
            (
                "artifact",
                artifact,
                images.iter().any(|i| i.artifact == artifact),
            ),
        ] {
            if taken {
                return Err(ImagesError::Duplicate {
                    line,
                    what,
                    value: value.to_string(),
                });
            }
        }
        images.push(KernelSource {
            name: name.to_string(),
            artifact: artifact.to_string(),
            kind,
            rel: entry.to_string(),
        });
    }
    Ok(images)
}

/// The images of the workspace's manifest ([`IMAGES_FILE`]); none when it does not exist.
pub fn read_images(workspace: &Path) -> Result<Vec<KernelSource>> {
    let path = workspace.join(IMAGES_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("reading", &path)(e)),
    };
    parse_images(&text).map_err(|e| {
        Error::io("parsing", &path)(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    })
}

/// A dependency file (header) with its content, identified by its workspace-relative path.
#[derive(Debug, Clone)]
pub struct Dep {
    /// Workspace-relative path.
    pub rel: String,
    /// Content.
    pub bytes: Vec<u8>,
}

/// Every file under `dir`, recursively, except `.cu` files (entries) and the image manifest,
/// sorted by path: what any entry may include.
fn read_deps(workspace: &Path, dir: &Path) -> Result<Vec<Dep>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io("listing", &d)(e)),
        };
        for entry in entries {
            let path = entry.map_err(Error::io("listing", &d))?.path();
            let rel = relative_to(workspace, &path);
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_none_or(|e| e != "cu") && rel != IMAGES_FILE {
                let bytes = fs::read(&path).map_err(Error::io("reading", &path))?;
                out.push(Dep { rel, bytes });
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

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

/// Everything that determines an artifact's bytes.
#[derive(Debug, Clone, Copy)]
pub struct HashInputs<'a> {
    /// How it is built.
    pub kind: KernelKind,
    /// Workspace-relative source path.
    pub source_rel: &'a str,
    /// Source content.
    pub source: &'a [u8],
    /// Headers it may include.
    pub deps: &'a [Dep],
    /// nvcc flags.
    pub nvcc_flags: &'a [String],
    /// nvlink flags (empty for fatbins).
    pub link_flags: &'a [String],
    /// `NvccVersion::text`.
    pub toolchain: &'a str,
    /// SHA-256 of `libnvshmem_device.a`, for NVSHMEM variants.
    pub nvshmem_lib: Option<&'a str>,
}

/// SHA-256 (hex) over all inputs; every field is length-prefixed so no two different input
/// sets can serialise to the same byte stream.
pub fn inputs_hash(i: &HashInputs<'_>) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"epcomm-kernel-inputs-v1");
    field(format!("{:?}", i.kind).as_bytes());
    field(i.source_rel.as_bytes());
    field(i.source);
    field(&(i.deps.len() as u64).to_le_bytes());
    for d in i.deps {
        field(d.rel.as_bytes());
        field(&d.bytes);
    }
    field(&(i.nvcc_flags.len() as u64).to_le_bytes());
    for f in i.nvcc_flags {
        field(f.as_bytes());
    }
    field(&(i.link_flags.len() as u64).to_le_bytes());
    for f in i.link_flags {
        field(f.as_bytes());
    }
    field(i.toolchain.as_bytes());
    field(i.nvshmem_lib.unwrap_or("").as_bytes());
    util::hex(&h.finalize())
}

/// What `manifest.json` records for one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Workspace-relative source path.
    pub source: String,
    /// How it was built.
    pub kind: KernelKind,
    /// [`inputs_hash`] of the inputs it was built from.
    pub inputs_sha256: String,
    /// nvcc flags used.
    pub flags: Vec<String>,
    /// nvlink flags used (empty for fatbins).
    #[serde(default)]
    pub link_flags: Vec<String>,
    /// nvcc version text.
    pub toolchain: String,
    /// Size of the artifact in bytes.
    pub size: u64,
}

/// `manifest.json`: every artifact in the output directory, keyed by file name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// Artifact file name → entry.
    pub artifacts: BTreeMap<String, ManifestEntry>,
}

impl Default for Manifest {
    fn default() -> Manifest {
        Manifest {
            version: MANIFEST_VERSION,
            artifacts: BTreeMap::new(),
        }
    }
}

impl Manifest {
    /// Reads `<out_dir>/manifest.json`. A missing, unreadable or other-version manifest reads as
    /// empty (everything stale), with a warning for the latter two.
    pub fn load(out_dir: &Path) -> Manifest {
        let path = out_dir.join(MANIFEST_NAME);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Manifest::default(),
            Err(e) => {
                eprintln!(
                    "build-kernels: warning: cannot read {}: {e}",
                    path.display()
                );
                return Manifest::default();
            }
        };
        match serde_json::from_str::<Manifest>(&text) {
            Ok(m) if m.version == MANIFEST_VERSION => m,
            Ok(m) => {
                eprintln!(
                    "build-kernels: {} has format version {}, expected {MANIFEST_VERSION}; rebuilding all",
                    path.display(),
                    m.version
                );
                Manifest::default()
            }
            Err(e) => {
                eprintln!(
                    "build-kernels: warning: {} is not a valid manifest ({e}); rebuilding all",
                    path.display()
                );
                Manifest::default()
            }
        }
    }

    /// Writes `<out_dir>/manifest.json` atomically.
    pub fn save(&self, out_dir: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(self).map_err(|e| Error::Io {
            action: "serialising the kernel manifest for",
            path: out_dir.join(MANIFEST_NAME),
            source: e.into(),
        })?;
        text.push('\n');
        util::write_atomic(&out_dir.join(MANIFEST_NAME), text.as_bytes())
    }
}

/// Why an artifact needs building (or that it does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staleness {
    /// Present, same size as recorded, built from the same inputs.
    UpToDate,
    /// The manifest has no entry for it.
    NotInManifest,
    /// The manifest has an entry but the file is gone.
    OutputMissing,
    /// The file's size differs from the recorded one (truncated or replaced).
    SizeChanged,
    /// Source, headers, flags or toolchain changed.
    InputsChanged,
}

impl Staleness {
    /// Words for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Staleness::UpToDate => "up to date",
            Staleness::NotInManifest => "never built (not in manifest)",
            Staleness::OutputMissing => "artifact file missing",
            Staleness::SizeChanged => "artifact size differs from manifest",
            Staleness::InputsChanged => "inputs changed (source, headers, flags or toolchain)",
        }
    }
}

/// Compares what the manifest recorded and what is on disk with the current inputs hash.
pub fn staleness(entry: Option<&ManifestEntry>, artifact: &Path, inputs_sha256: &str) -> Staleness {
    let Some(entry) = entry else {
        return Staleness::NotInManifest;
    };
    let Ok(meta) = fs::metadata(artifact) else {
        return Staleness::OutputMissing;
    };
    if meta.len() != entry.size {
        Staleness::SizeChanged
    } else if entry.inputs_sha256 != inputs_sha256 {
        Staleness::InputsChanged
    } else {
        Staleness::UpToDate
    }
}

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

/// Runs `build-kernels` (or `--check`) for `layout`.
pub fn build(layout: &Layout, env: &ToolchainEnv, opts: BuildOptions) -> Result<BuildSummary> {
    let sources = read_images(&layout.workspace)?;
    let mut manifest = Manifest::load(&layout.out_dir);
    if sources.is_empty() {
        println!(
            "build-kernels: no kernel images listed in {}; nothing to do",
            layout.workspace.join(IMAGES_FILE).display()
        );
        if opts.check {
            return Ok(BuildSummary::default());
        }
        fs::create_dir_all(&layout.out_dir).map_err(Error::io("creating", &layout.out_dir))?;
        let removed = remove_orphans(layout, &mut manifest, &BTreeSet::new())?;
        manifest.save(&layout.out_dir)?;
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
    let nvshmem = if sources.iter().any(|s| s.kind == KernelKind::NvshmemCubin) {
        Some(Nvshmem::resolve(env, !opts.check)?)
    } else {
        None
    };

    let deps = read_deps(&layout.workspace, &layout.kernels_dir())?;

    let mut plans = Vec::new();
    for src in &sources {
        let source_bytes = fs::read(layout.workspace.join(&src.rel))
            .map_err(Error::io("reading", &layout.workspace.join(&src.rel)))?;
        let (nvcc_flags, link_flags) = flags(src.kind, &layout.workspace, &tc, nvshmem.as_ref());
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
                KernelKind::NvshmemCubin => nvshmem.as_ref().map(|n| n.device_lib_sha256.as_str()),
            },
        });
        let state = staleness(
            manifest.artifacts.get(&src.artifact),
            &layout.out_dir.join(&src.artifact),
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

    let wanted: BTreeSet<String> = plans.iter().map(|p| p.src.artifact.clone()).collect();
    if opts.check {
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
            layout.out_dir.display()
        );
        return Ok(BuildSummary {
            up_to_date: plans.iter().map(|p| p.src.artifact.clone()).collect(),
            ..BuildSummary::default()
        });
    }

    fs::create_dir_all(&layout.out_dir).map_err(Error::io("creating", &layout.out_dir))?;
    let mut summary = BuildSummary {
        removed: remove_orphans(layout, &mut manifest, &wanted)?,
        ..BuildSummary::default()
    };

    let (todo, done): (Vec<Plan>, Vec<Plan>) = plans
        .into_iter()
        .partition(|p| opts.force || p.state != Staleness::UpToDate);
    summary.up_to_date = done.iter().map(|p| p.src.artifact.clone()).collect();

    let results = if todo.is_empty() {
        Vec::new()
    } else {
        let nvlink = if todo.iter().any(|p| p.src.kind == KernelKind::NvshmemCubin) {
            Some(tc.nvlink(env.path.as_deref())?)
        } else {
            None
        };
        let ctx = CompileCtx {
            layout,
            toolchain: &tc,
            nvlink: nvlink.as_deref(),
            verbose: opts.verbose,
        };
        compile_all(&ctx, &todo)
    };

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
    manifest.save(&layout.out_dir)?;
    println!(
        "build-kernels: {} built, {} up to date{} -> {}",
        summary.built.len(),
        summary.up_to_date.len(),
        if failures.is_empty() {
            String::new()
        } else {
            format!(", {} FAILED", failures.len())
        },
        layout.out_dir.display()
    );
    if failures.is_empty() {
        Ok(summary)
    } else {
        Err(Error::KernelsFailed { failures })
    }
}

/// Deletes the artifacts the manifest lists but no source produces any more (only files the
/// manifest names, so nothing else in the output directory is touched); returns their names.
fn remove_orphans(
    layout: &Layout,
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
        let path = layout.out_dir.join(orphan);
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

struct CompileCtx<'a> {
    layout: &'a Layout,
    toolchain: &'a Toolchain,
    nvlink: Option<&'a Path>,
    verbose: bool,
}

/// Compiles `plans` on up to `available_parallelism` threads; results are in `plans` order.
fn compile_all(ctx: &CompileCtx<'_>, plans: &[Plan]) -> Vec<Result<u64, CompileFailure>> {
    let workers = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(plans.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<u64, CompileFailure>>>> =
        Mutex::new((0..plans.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(plan) = plans.get(i) else { break };
                    let r = compile_one(ctx, plan);
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
        .zip(plans)
        .map(|(r, plan)| {
            r.unwrap_or_else(|| {
                Err(CompileFailure {
                    source: plan.src.rel.clone(),
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
    cmd.current_dir(&ctx.layout.workspace);
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
fn compile_one(ctx: &CompileCtx<'_>, plan: &Plan) -> Result<u64, CompileFailure> {
    let started = Instant::now();
    let src = &plan.src;
    let out = ctx.layout.out_dir.join(&src.artifact);
    let tmp = util::temp_sibling(&out);
    let io_fail = |what: &str, e: std::io::Error| CompileFailure {
        source: src.rel.clone(),
        command: String::new(),
        output: format!("{what}: {e}"),
    };
    match src.kind {
        KernelKind::Fatbin => {
            let mut cmd = Command::new(&ctx.toolchain.nvcc);
            cmd.args(&plan.entry.flags)
                .arg(&src.rel)
                .arg("-o")
                .arg(&tmp);
            run_tool(ctx, src, &mut cmd).inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })?;
        }
        KernelKind::NvshmemCubin => {
            let rdc =
                ctx.layout
                    .out_dir
                    .join(format!(".{}.rdc.{}.cubin", src.name, std::process::id()));
            let mut cmd = Command::new(&ctx.toolchain.nvcc);
            cmd.args(&plan.entry.flags)
                .arg(&src.rel)
                .arg("-o")
                .arg(&rdc);
            let compiled = run_tool(ctx, src, &mut cmd);
            let linked = compiled.and_then(|()| {
                let nvlink = ctx.nvlink.ok_or_else(|| CompileFailure {
                    source: src.rel.clone(),
                    command: String::new(),
                    output: "nvlink was not resolved".to_string(),
                })?;
                let mut link = Command::new(nvlink);
                link.arg(&rdc)
                    .args(&plan.entry.link_flags)
                    .arg("-o")
                    .arg(&tmp);
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
    use super::*;
    use crate::toolchain::{NvccOrigin, NvccVersion};
    use crate::util::TempDir;

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

    fn inputs<'a>(src: &'a [u8], deps: &'a [Dep], flags: &'a [String]) -> HashInputs<'a> {
        HashInputs {
            kind: KernelKind::Fatbin,
            source_rel: "kernels/a.cu",
            source: src,
            deps,
            nvcc_flags: flags,
            link_flags: &[],
            toolchain: "V13.0.88",
            nvshmem_lib: None,
        }
    }

    #[test]
    fn hash_changes_with_every_input() {
        let deps = vec![Dep {
            rel: "kernels/include/a.cuh".into(),
            bytes: b"#pragma once".to_vec(),
        }];
        let flags = vec!["-O3".to_string()];
        let base = inputs_hash(&inputs(b"src", &deps, &flags));
        assert_eq!(base.len(), 64);
        assert_eq!(
            base,
            inputs_hash(&inputs(b"src", &deps, &flags)),
            "deterministic"
        );

        assert_ne!(base, inputs_hash(&inputs(b"src2", &deps, &flags)), "source");
        let mut deps2 = deps.clone();
        deps2[0].bytes.push(b' ');
        assert_ne!(
            base,
            inputs_hash(&inputs(b"src", &deps2, &flags)),
            "header content"
        );
        let mut deps3 = deps.clone();
        deps3[0].rel = "kernels/include/b.cuh".into();
        assert_ne!(
            base,
            inputs_hash(&inputs(b"src", &deps3, &flags)),
            "header name"
        );
        assert_ne!(
            base,
            inputs_hash(&inputs(b"src", &[], &flags)),
            "header removed"
        );
        let flags2 = vec!["-O2".to_string()];
        assert_ne!(base, inputs_hash(&inputs(b"src", &deps, &flags2)), "flags");
        let mut i = inputs(b"src", &deps, &flags);
        i.toolchain = "V13.0.89";
        assert_ne!(base, inputs_hash(&i), "toolchain");
        let mut i = inputs(b"src", &deps, &flags);
        i.nvshmem_lib = Some("abc");
        assert_ne!(base, inputs_hash(&i), "nvshmem lib");
        let mut i = inputs(b"src", &deps, &flags);
        i.kind = KernelKind::NvshmemCubin;
        assert_ne!(base, inputs_hash(&i), "kind");
    }

    #[test]
    fn hash_fields_cannot_run_into_each_other() {
        let ab = vec!["-a".to_string(), "b".to_string()];
        let a_b = vec!["-ab".to_string()];
        assert_ne!(
            inputs_hash(&inputs(b"x", &[], &ab)),
            inputs_hash(&inputs(b"x", &[], &a_b))
        );
    }

    #[test]
    fn staleness_covers_every_case() {
        let t = TempDir::new("stale");
        let art = t.write("k.fatbin", "12345");
        let entry = ManifestEntry {
            source: "kernels/k.cu".into(),
            kind: KernelKind::Fatbin,
            inputs_sha256: "h1".into(),
            flags: vec![],
            link_flags: vec![],
            toolchain: "t".into(),
            size: 5,
        };
        assert_eq!(staleness(None, &art, "h1"), Staleness::NotInManifest);
        assert_eq!(staleness(Some(&entry), &art, "h1"), Staleness::UpToDate);
        assert_eq!(
            staleness(Some(&entry), &art, "h2"),
            Staleness::InputsChanged
        );
        fs::write(&art, "123").expect("truncate");
        assert_eq!(staleness(Some(&entry), &art, "h1"), Staleness::SizeChanged);
        fs::remove_file(&art).expect("rm");
        assert_eq!(
            staleness(Some(&entry), &art, "h1"),
            Staleness::OutputMissing
        );
    }

    #[test]
    fn parses_the_image_manifest() {
        let images = parse_images(
            "# comment\n\na  a.fatbin  fatbin  kernels/x/a.cu  # trailing\n\
             b_2 b.cubin nvshmem_cubin kernels/b.cu\n",
        )
        .expect("parse");
        assert_eq!(
            images,
            [
                KernelSource {
                    name: "a".into(),
                    artifact: "a.fatbin".into(),
                    kind: KernelKind::Fatbin,
                    rel: "kernels/x/a.cu".into(),
                },
                KernelSource {
                    name: "b_2".into(),
                    artifact: "b.cubin".into(),
                    kind: KernelKind::NvshmemCubin,
                    rel: "kernels/b.cu".into(),
                },
            ]
        );
        let line2 = |text: &str| parse_images(&format!("a a.fatbin fatbin kernels/a.cu\n{text}\n"));
        for (text, expected) in [
            ("b b.fatbin fatbin", "Fields { line: 2, found: 3 }"),
            ("B b.fatbin fatbin kernels/b.cu", "Name {"),
            ("b b.fatbin ptx kernels/b.cu", "Build {"),
            ("b b.cubin fatbin kernels/b.cu", "Artifact {"),
            ("b x/b.fatbin fatbin kernels/b.cu", "Artifact {"),
            ("b .fatbin fatbin kernels/b.cu", "Artifact {"),
            ("b b.fatbin fatbin src/b.cu", "Entry {"),
            ("b b.fatbin fatbin kernels/b.cuh", "Entry {"),
            (
                "a b.fatbin fatbin kernels/b.cu",
                "Duplicate { line: 2, what: \"name\"",
            ),
        ] {
            let err = line2(text).expect_err(text);
            assert!(format!("{err:?}").starts_with(expected), "{text}: {err:?}");
        }
        let dup = line2("b a.fatbin fatbin kernels/b.cu").expect_err("same artifact");
        assert_eq!(
            dup.to_string(),
            "kernels/images.txt:2: artifact `a.fatbin` is already listed"
        );
    }

    #[test]
    fn deps_are_every_header_under_kernels() {
        let t = TempDir::new("deps");
        assert!(read_images(t.path()).expect("no manifest").is_empty());
        t.write("kernels/a/a.cu", "");
        t.write("kernels/common/x.cuh", "");
        t.write("kernels/a/y.cuh", "");
        t.write(IMAGES_FILE, "a a.fatbin fatbin kernels/a/a.cu\n");
        let deps = read_deps(t.path(), &t.path().join("kernels")).expect("deps");
        let names: Vec<&str> = deps.iter().map(|d| d.rel.as_str()).collect();
        assert_eq!(names, ["kernels/a/y.cuh", "kernels/common/x.cuh"]);
        t.write(IMAGES_FILE, "a a.fatbin fatbin\n");
        let err = read_images(t.path()).expect_err("bad manifest").to_string();
        assert!(
            err.contains("kernels/images.txt:1: expected 4 fields"),
            "{err}"
        );
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

    #[test]
    fn manifest_round_trips_and_bad_manifest_reads_as_empty() {
        let t = TempDir::new("manifest");
        let mut m = Manifest::default();
        m.artifacts.insert(
            "a.fatbin".into(),
            ManifestEntry {
                source: "kernels/a.cu".into(),
                kind: KernelKind::Fatbin,
                inputs_sha256: "00".into(),
                flags: vec!["-O3".into()],
                link_flags: vec![],
                toolchain: "V13.0.88".into(),
                size: 7,
            },
        );
        m.save(t.path()).expect("save");
        assert_eq!(Manifest::load(t.path()), m);
        t.write(MANIFEST_NAME, "{not json");
        assert_eq!(Manifest::load(t.path()), Manifest::default());
        t.write(MANIFEST_NAME, r#"{"version": 99, "artifacts": {}}"#);
        assert_eq!(Manifest::load(t.path()), Manifest::default());
    }

    /// A fake nvcc: answers `--version`, copies its input (`$N`, the argument before `-o`)
    /// to the output after `-o`, fails on sources containing `#error`, and logs each call.
    #[cfg(unix)]
    fn fake_nvcc_env(t: &TempDir) -> ToolchainEnv {
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
        ToolchainEnv {
            cuda_home: None,
            nvshmem_home: None,
            path: Some(t.path().join("bin").into_os_string()),
            pip_root: t.path().join("ws/target/cuda-toolchain"),
            python: "false".into(),
        }
    }

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
        let t = TempDir::new("incr");
        let env = fake_nvcc_env(&t);
        let ws = t.path().join("ws");
        let layout = Layout {
            workspace: ws.clone(),
            out_dir: ws.join("target/kernels"),
            pip_root: env.pip_root.clone(),
        };
        let check = BuildOptions {
            check: true,
            ..BuildOptions::default()
        };
        // No kernels directory: nothing to do, not even nvcc needed.
        let s = build(&layout, &env, BuildOptions::default()).expect("empty");
        assert!(s.built.is_empty());

        t.write("ws/kernels/a.cu", "A");
        t.write("ws/kernels/b.cu", "B");
        t.write("ws/kernels/common/common.cuh", "H1");
        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "a a.fatbin fatbin kernels/a.cu\nb b.fatbin fatbin kernels/b.cu\n",
        );
        let err = build(&layout, &env, check).expect_err("nothing built yet");
        assert!(
            matches!(&err, Error::StaleKernels { stale } if stale.len() == 2),
            "{err}"
        );

        let s = build(&layout, &env, BuildOptions::default()).expect("first build");
        assert_eq!(s.built, ["a.fatbin", "b.fatbin"]);
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);
        assert_eq!(
            fs::read_to_string(layout.out_dir.join("a.fatbin")).expect("a"),
            "A"
        );
        build(&layout, &env, check).expect("fresh after build");
        let m = Manifest::load(&layout.out_dir);
        assert_eq!(m.artifacts["b.fatbin"].size, 1);
        assert_eq!(m.artifacts["b.fatbin"].source, "kernels/b.cu");

        let s = build(&layout, &env, BuildOptions::default()).expect("no-op");
        assert!(s.built.is_empty() && s.up_to_date.len() == 2, "{s:?}");
        assert!(calls(&t).is_empty());

        t.write("ws/kernels/b.cu", "B2");
        let err = build(&layout, &env, check).expect_err("b changed");
        assert!(
            err.to_string()
                .contains("b.fatbin (kernels/b.cu): inputs changed"),
            "{err}"
        );
        build(&layout, &env, BuildOptions::default()).expect("rebuild b");
        assert_eq!(calls(&t), ["kernels/b.cu"]);

        t.write("ws/kernels/common/common.cuh", "H2");
        build(&layout, &env, BuildOptions::default()).expect("header change");
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);

        fs::remove_file(layout.out_dir.join("a.fatbin")).expect("rm");
        build(&layout, &env, BuildOptions::default()).expect("missing output");
        assert_eq!(calls(&t), ["kernels/a.cu"]);

        let force = BuildOptions {
            force: true,
            ..BuildOptions::default()
        };
        build(&layout, &env, force).expect("force");
        assert_eq!(calls(&t), ["kernels/a.cu", "kernels/b.cu"]);

        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "a a.fatbin fatbin kernels/a.cu\n",
        );
        let s = build(&layout, &env, BuildOptions::default()).expect("orphan");
        assert_eq!(s.removed, ["b.fatbin"]);
        assert!(!layout.out_dir.join("b.fatbin").exists());
        assert!(
            !Manifest::load(&layout.out_dir)
                .artifacts
                .contains_key("b.fatbin")
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_kernel_reports_stderr_and_keeps_the_others() {
        let t = TempDir::new("fail");
        let env = fake_nvcc_env(&t);
        let ws = t.path().join("ws");
        let layout = Layout {
            workspace: ws.clone(),
            out_dir: ws.join("out"),
            pip_root: env.pip_root.clone(),
        };
        t.write("ws/kernels/good.cu", "ok");
        t.write("ws/kernels/bad.cu", "#error nope");
        t.write(
            &format!("ws/{IMAGES_FILE}"),
            "good good.fatbin fatbin kernels/good.cu\nbad bad.fatbin fatbin kernels/bad.cu\n",
        );
        let err = build(&layout, &env, BuildOptions::default()).expect_err("bad fails");
        let msg = err.to_string();
        assert!(msg.contains("--- kernels/bad.cu ---"), "{msg}");
        assert!(msg.contains("kernels/bad.cu(1): error: boom"), "{msg}");
        let m = Manifest::load(&layout.out_dir);
        assert!(m.artifacts.contains_key("good.fatbin"));
        assert!(!m.artifacts.contains_key("bad.fatbin"));
        assert!(!layout.out_dir.join("bad.fatbin").exists());
        let leftovers: Vec<_> = fs::read_dir(&layout.out_dir)
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
        let real = Layout::from_env();
        let env = ToolchainEnv::from_process(real.pip_root.clone());
        if let Err(searched) = crate::toolchain::locate_nvcc(&env) {
            eprintln!("skipping: no nvcc available (searched: {searched:?})");
            return;
        }
        let t = TempDir::new("real");
        let ws = t.path().to_path_buf();
        let layout = Layout {
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
        let with_nvshmem = crate::toolchain::locate_nvshmem(&env).is_ok();
        let mut images = "tiny tiny.fatbin fatbin kernels/tiny/tiny.cu\n".to_string();
        if with_nvshmem {
            images.push_str("tiny_put tiny_put.cubin nvshmem_cubin kernels/tiny/put.cu\n");
            t.write(
                "kernels/tiny/put.cu",
                "#include <nvshmem.h>\n#include <nvshmemx.h>\n\
                 extern \"C\" __global__ void tiny_put(int* sig, int pe) { nvshmem_int_p(sig, 1, pe); nvshmem_quiet(); }\n",
            );
        } else {
            eprintln!("note: NVSHMEM not found; compiling the fatbin only");
        }
        t.write(IMAGES_FILE, &images);
        let s = build(&layout, &env, BuildOptions::default()).expect("real nvcc build");
        assert_eq!(s.built.len(), if with_nvshmem { 2 } else { 1 });
        let fatbin = fs::read(layout.out_dir.join("tiny.fatbin")).expect("fatbin");
        // Fatbin files start with the fatbin magic 0xBA55ED50 (little-endian).
        assert_eq!(&fatbin[..4], &[0x50, 0xed, 0x55, 0xba]);
        if with_nvshmem {
            let cubin = fs::read(layout.out_dir.join("tiny_put.cubin")).expect("cubin");
            assert_eq!(&cubin[..4], b"\x7fELF");
        }
        build(
            &layout,
            &env,
            BuildOptions {
                check: true,
                ..BuildOptions::default()
            },
        )
        .expect("up to date");
    }
}
