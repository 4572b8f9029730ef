//! What an artifact is built from, and the one hash over all of it that decides whether it is
//! up to date: the entry source, every header under `kernels/` (any entry may include any of
//! them; there is no include scanning, so a header change rebuilds every image), the nvcc and
//! nvlink flags, the nvcc version and, for NVSHMEM images, `libnvshmem_device.a`.

use std::fs;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::images::{IMAGES_FILE, KernelKind};
use crate::error::{Error, Result};
use crate::util::{self, relative_to};

/// A dependency file (header) with its content, identified by its workspace-relative path.
#[derive(Debug, Clone)]
pub struct Dep {
    /// Workspace-relative path.
    pub rel: String,
    /// Content.
    pub bytes: Vec<u8>,
}

/// Every file under `dir`, recursively, except `.cu` files (entries) and the image manifest,
/// sorted by workspace-relative path: what any entry may include. A missing `dir` has none.
pub fn read_deps(workspace: &Path, dir: &Path) -> Result<Vec<Dep>> {
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
/// sets can serialise to the same byte stream. The hash is what `manifest.json` records:
/// changing how it is computed makes every artifact stale once.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TempDir;

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
    fn deps_are_every_header_under_kernels() {
        let t = TempDir::new("deps");
        t.write("kernels/a/a.cu", "");
        t.write("kernels/common/x.cuh", "");
        t.write("kernels/a/y.cuh", "");
        t.write(IMAGES_FILE, "a a.fatbin fatbin kernels/a/a.cu\n");
        let deps = read_deps(t.path(), &t.path().join("kernels")).expect("deps");
        let names: Vec<&str> = deps.iter().map(|d| d.rel.as_str()).collect();
        assert_eq!(names, ["kernels/a/y.cuh", "kernels/common/x.cuh"]);
        assert!(
            read_deps(t.path(), &t.path().join("nowhere"))
                .expect("no kernels directory")
                .is_empty()
        );
    }
}
