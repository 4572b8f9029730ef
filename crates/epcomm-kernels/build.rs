//! Embeds the kernel artifacts written by `cargo xtask build-kernels`.
//!
//! Looks in one directory, the first that applies:
//!
//! 1. `$EPCOMM_KERNEL_DIR`, when set and not empty;
//! 2. `<crate>/prebuilt/`, when this is a packaged copy of the crate (crates.io, `cargo
//!    package`: it has a `Cargo.toml.orig`). `prebuilt/` is what a release ships; see
//!    docs/build.md;
//! 3. `<workspace>/target/kernels`, in the workspace checkout.
//!
//! A missing artifact is not a build error: the crate then reads it from `$EPCOMM_KERNEL_DIR`
//! at run time and, failing that, reports that `cargo xtask build-kernels` must run.
use std::{env, fmt::Write as _, fs, path::PathBuf};

const ARTIFACTS: &[(&str, &str)] = &[
    ("INTRANODE", "intranode.fatbin"),
    ("INTRANODE_NVSHMEM", "intranode_nvshmem.cubin"),
];

fn main() {
    println!("cargo:rerun-if-env-changed=EPCOMM_KERNEL_DIR");
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let packaged = manifest.join("Cargo.toml.orig").is_file();
    let dir = match env::var_os("EPCOMM_KERNEL_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None if packaged => manifest.join("prebuilt"),
        None => manifest.join("../../target/kernels"),
    };
    let mut code = String::new();
    for (name, file) in ARTIFACTS {
        let path = dir.join(file);
        println!("cargo:rerun-if-changed={}", path.display());
        match fs::canonicalize(&path) {
            Ok(abs) => writeln!(
                code,
                "pub(crate) static {name}: Option<&[u8]> = Some(include_bytes!({:?}));",
                abs.display().to_string()
            ),
            Err(_) => writeln!(code, "pub(crate) static {name}: Option<&[u8]> = None;"),
        }
        .expect("writing to a String cannot fail");
        writeln!(
            code,
            "pub(crate) const {name}_PATH: &str = {:?};",
            path.display().to_string()
        )
        .expect("writing to a String cannot fail");
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("embedded.rs");
    fs::write(out, code).expect("OUT_DIR is writable");
}
