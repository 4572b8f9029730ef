//! The image manifest, `kernels/images.txt`: which kernel images exist, how each is built and
//! from which entry source. It drives `build-kernels`, `pack-device` and, through `cargo xtask
//! codegen`, the image table that `epcomm-kernels` embeds from.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

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
    /// For an NVSHMEM image, the NVSHMEM release (`major.minor.patch`) it is device-linked
    /// against; `None` for the others.
    pub nvshmem_release: Option<String>,
}

/// A line of the image manifest that does not follow its format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImagesError {
    /// Not four fields (five for an NVSHMEM image).
    #[error(
        "{IMAGES_FILE}:{line}: expected 4 fields (name artifact build entry), 5 for nvshmem_cubin \
         (... entry release), found {found}"
    )]
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
    /// An NVSHMEM release that is not `major.minor.patch`.
    #[error(
        "{IMAGES_FILE}:{line}: NVSHMEM release `{release}` must be major.minor.patch, e.g. 3.4.5"
    )]
    Release {
        /// 1-based line number.
        line: usize,
        /// The field found.
        release: String,
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
/// line is `name artifact build entry`, separated by whitespace, with a fifth field, the
/// NVSHMEM release (`major.minor.patch`), for an `nvshmem_cubin` image. Names are unique lower-case
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
        let (name, artifact, build, entry, release) = match *fields.as_slice() {
            [name, artifact, build, entry] => (name, artifact, build, entry, None),
            [name, artifact, build, entry, release] => {
                (name, artifact, build, entry, Some(release))
            }
            _ => {
                return Err(ImagesError::Fields {
                    line,
                    found: fields.len(),
                });
            }
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
        // An NVSHMEM image names its release; no other image has one.
        if (kind == KernelKind::NvshmemCubin) != release.is_some() {
            return Err(ImagesError::Fields {
                line,
                found: fields.len(),
            });
        }
        if let Some(r) = release
            && parse_release(r).is_none()
        {
            return Err(ImagesError::Release {
                line,
                release: r.to_string(),
            });
        }
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
            nvshmem_release: release.map(str::to_string),
        });
    }
    Ok(images)
}

/// `major.minor.patch` as three numbers.
pub fn parse_release(text: &str) -> Option<(u32, u32, u32)> {
    let mut parts = text.split('.').map(str::parse::<u32>);
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b)), Some(Ok(c)), None) => Some((a, b, c)),
        _ => None,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

    #[test]
    fn parses_the_image_manifest() {
        let images = parse_images(
            "# comment\n\na  a.fatbin  fatbin  kernels/x/a.cu  # trailing\n\
             b_2 b.cubin nvshmem_cubin kernels/b.cu 3.4.5\n",
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
                    nvshmem_release: None,
                },
                KernelSource {
                    name: "b_2".into(),
                    artifact: "b.cubin".into(),
                    kind: KernelKind::NvshmemCubin,
                    rel: "kernels/b.cu".into(),
                    nvshmem_release: Some("3.4.5".into()),
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
            (
                "b b.cubin nvshmem_cubin kernels/b.cu",
                "Fields { line: 2, found: 4 }",
            ),
            (
                "b b.fatbin fatbin kernels/b.cu 3.4.5",
                "Fields { line: 2, found: 5 }",
            ),
            ("b b.cubin nvshmem_cubin kernels/b.cu 3.4", "Release {"),
            ("b b.cubin nvshmem_cubin kernels/b.cu 3.x.5", "Release {"),
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
    fn reads_no_images_without_a_manifest_and_names_the_bad_line() {
        let t = TempDir::new("images");
        assert!(read_images(t.path()).expect("no manifest").is_empty());
        t.write(IMAGES_FILE, "a a.fatbin fatbin kernels/a/a.cu\n");
        assert_eq!(read_images(t.path()).expect("manifest").len(), 1);
        t.write(IMAGES_FILE, "a a.fatbin fatbin\n");
        let err = read_images(t.path()).expect_err("bad manifest").to_string();
        assert!(
            err.contains("kernels/images.txt:1: expected 4 fields"),
            "{err}"
        );
    }
}
