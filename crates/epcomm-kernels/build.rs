//! Embeds the kernel artifacts written by `cargo xtask build-kernels`.
//!
//! Looks in `$EPCOMM_KERNEL_DIR`, else `<workspace>/target/kernels`. A missing artifact is not a
//! build error: the crate then reports, at load time, that `cargo xtask build-kernels` must run.
use std::{env, fmt::Write as _, fs, path::PathBuf};

const ARTIFACTS: &[(&str, &str)] = &[
    ("INTRANODE", "intranode.fatbin"),
    ("INTRANODE_NVSHMEM", "intranode_nvshmem.cubin"),
];

fn main() {
    println!("cargo:rerun-if-env-changed=EPCOMM_KERNEL_DIR");
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let dir = env::var_os("EPCOMM_KERNEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../../target/kernels"));
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
