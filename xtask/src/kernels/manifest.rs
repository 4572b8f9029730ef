//! `manifest.json` in the output directory: the build record of every artifact there (its
//! source, inputs hash, flags, toolchain and size), and the comparison of that record with the
//! disk and the current inputs that says whether an artifact is stale, and why.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::images::KernelKind;
use crate::error::{Error, Result};
use crate::util;

/// Version of the manifest format; a different version makes every artifact stale.
pub const MANIFEST_VERSION: u32 = 1;
/// File name of the manifest inside the output directory.
pub const MANIFEST_NAME: &str = "manifest.json";

/// What `manifest.json` records for one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Workspace-relative source path.
    pub source: String,
    /// How it was built.
    pub kind: KernelKind,
    /// [`inputs_hash`](super::inputs::inputs_hash) of the inputs it was built from.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

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
}
