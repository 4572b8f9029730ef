//! Embeds the kernel artifacts written by `cargo xtask build-kernels`: one per line of the image
//! manifest (`kernels/images.txt`, turned into `src/images_generated.rs` by `cargo xtask
//! codegen`, so a packaged copy of the crate has it too).
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

include!("src/images_generated.rs");

fn main() {
    println!("cargo:rerun-if-env-changed=EPCOMM_KERNEL_DIR");
    println!("cargo:rerun-if-changed=src/images_generated.rs");
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let packaged = manifest.join("Cargo.toml.orig").is_file();
    let dir = match env::var_os("EPCOMM_KERNEL_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None if packaged => manifest.join("prebuilt"),
        None => manifest.join("../../target/kernels"),
    };
    let n = IMAGE_TABLE.len();
    let mut bytes = format!("pub(crate) static EMBEDDED: [Option<&[u8]>; {n}] = [\n");
    let mut paths = format!("pub(crate) const BUILD_PATHS: [&str; {n}] = [\n");
    for (_, artifact, _, _, _) in IMAGE_TABLE {
        let path = dir.join(artifact);
        println!("cargo:rerun-if-changed={}", path.display());
        match fs::canonicalize(&path) {
            Ok(abs) => writeln!(
                bytes,
                "    Some(include_bytes!({:?})),",
                abs.display().to_string()
            ),
            Err(_) => writeln!(bytes, "    None,"),
        }
        .expect("writing to a String cannot fail");
        writeln!(paths, "    {:?},", path.display().to_string())
            .expect("writing to a String cannot fail");
    }
    let code = format!(
        "/// Each image's bytes when embedded, in `IMAGE_TABLE` order.\n{bytes}];\n\
         /// Where the build script looked for each image, in `IMAGE_TABLE` order.\n{paths}];\n"
    );
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("embedded.rs");
    fs::write(out, code).expect("OUT_DIR is writable");
}
