//! Developer tasks for the epcomm workspace; run as `cargo xtask <command>`.
//!
//! * `build-kernels` — compile `kernels/` with nvcc into `target/kernels` (see docs/build.md).
//! * `pack-device` — pack release binaries, test executables and kernels for the GPU machine
//!   (see docs/gpu-testing.md).
//! * `test` — build the kernels and run every test (GPU tests too when a GPU is present).
//! * `bench` — build the kernels and run the main job, `epcomm bench`, on every local GPU.
//! * `codegen` — regenerate (or `--check`) what the Rust side mirrors of `kernels/`: the ABI
//!   (`kernels/common/abi.cuh`) and the image table (`kernels/images.txt`) (see docs/build.md).
//! * `bindgen-nvshmem` — regenerate (or `--check`) the vendored NVSHMEM host bindings of
//!   `nvshmem-sys` (see docs/nvshmem.md).
//! * `wheel` — build (or `--check`) the Python wheel with the kernels inside (see
//!   docs/python.md).

mod bindgen_nvshmem;
mod codegen;
mod error;
mod kernels;
mod pack;
mod test_cmd;
mod toolchain;
mod util;
mod wheel;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::kernels::{BuildOptions, Paths};
use crate::toolchain::ToolchainEnv;

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    about = "Developer tasks for the epcomm workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Compile every image of kernels/images.txt (fatbins, NVSHMEM-linked cubins) into
    /// target/kernels (or $EPCOMM_KERNEL_DIR), rebuilding only what changed.
    BuildKernels {
        /// Verify every artifact is present and up to date; build nothing, exit 1 if stale.
        #[arg(long, conflicts_with = "force")]
        check: bool,
        /// Rebuild every artifact.
        #[arg(long)]
        force: bool,
        /// Print the toolchain and every nvcc/nvlink command.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Build release artifacts for the GPU machine and pack them into one folder.
    PackDevice {
        /// Output folder [default: target/device in the workspace].
        #[arg(long)]
        out: Option<PathBuf>,
        /// More packages whose test executables to pack (epcomm and epcomm-check, which has
        /// the GPU tests, are always packed).
        #[arg(long = "package", short = 'p', value_name = "PACKAGE")]
        packages: Vec<String>,
        /// Print more.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Build the kernels and run `cargo test --workspace` (GPU tests too when a GPU is present).
    Test {
        /// Extra arguments for `cargo test` (put them after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cargo_args: Vec<String>,
    },
    /// Build the kernels, then run the verified dispatch/combine benchmark on every local GPU
    /// (`cargo run --release -p epcomm-cli -- bench [ARGS...]`), exiting with its code. Without
    /// a CUDA driver it builds nothing and exits 3 at once.
    Bench {
        /// Arguments for `epcomm bench` (e.g. `--sms 32 --schedule global`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        bench_args: Vec<String>,
    },
    /// Generate the Rust mirror of kernels/common/abi.cuh (and the device ABI probe) and the
    /// kernel image table of kernels/images.txt.
    Codegen {
        /// Generate in memory and fail if a checked-in file differs; write nothing.
        #[arg(long)]
        check: bool,
    },
    /// Generate crates/nvshmem-sys/src/bindings.rs from the pinned NVSHMEM headers with bindgen.
    BindgenNvshmem {
        /// Regenerate into target/ and fail if the committed file differs; skip (exit 0) when
        /// libclang or the headers are missing.
        #[arg(long)]
        check: bool,
    },
    /// Build the kernels, then the Python wheel (python/, crates/epcomm-py) into target/wheels
    /// with the kernels inside, and verify it.
    Wheel {
        /// Verify the wheel in target/wheels against the sources and kernels; build nothing.
        #[arg(long, conflicts_with_all = ["test", "install"])]
        check: bool,
        /// Also run python/tests (pytest) in target/python-venv.
        #[arg(long)]
        test: bool,
        /// Also pip-install the wheel into $PYTHON (default python3).
        #[arg(long)]
        install: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let paths = Paths::from_env();
    let env = ToolchainEnv::from_process(paths.pip_root.clone());
    let result = match cli.command {
        Cmd::BuildKernels {
            check,
            force,
            verbose,
        } => kernels::build(
            &paths,
            &env,
            BuildOptions {
                check,
                force,
                verbose,
            },
        )
        .map(|_| ()),
        Cmd::PackDevice {
            out,
            packages,
            verbose,
        } => {
            let opts = pack::PackOptions {
                out: out.unwrap_or_else(|| paths.workspace.join("target/device")),
                packages: pack::package_list(packages),
                verbose,
            };
            pack::pack(&paths, &env, &opts)
        }
        Cmd::Test { cargo_args } => test_cmd::run(&paths, &env, &cargo_args),
        Cmd::Bench { bench_args } => {
            // `epcomm bench`'s exit code is the command's (3: no usable GPU environment).
            return match test_cmd::bench(&paths, &env, &bench_args) {
                Ok(code) => ExitCode::from(code),
                Err(e) => report::<&str, _>(Err(e)),
            };
        }
        Cmd::Codegen { check } => return report(codegen::run(&paths.workspace, check)),
        Cmd::BindgenNvshmem { check } => {
            let paths = bindgen_nvshmem::BindgenPaths::new(&paths.workspace, &paths.pip_root);
            return report(bindgen_nvshmem::run(&paths, check));
        }
        Cmd::Wheel {
            check,
            test,
            install,
        } => {
            let opts = wheel::WheelOptions {
                check,
                test,
                install,
            };
            return report(wheel::run(&paths, &env, opts));
        }
    };
    report(result.map(|()| ""))
}

/// Prints what a command did (when it says anything) or its error, and gives the exit code.
fn report<T: std::fmt::Display, E: std::fmt::Display>(result: Result<T, E>) -> ExitCode {
    match result {
        Ok(outcome) => {
            let outcome = outcome.to_string();
            if !outcome.is_empty() {
                println!("{outcome}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn cli_is_well_formed_and_parses_the_documented_forms() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from(["xtask", "build-kernels", "--check", "-v"]).expect("parse");
        assert!(matches!(
            c.command,
            Cmd::BuildKernels {
                check: true,
                force: false,
                verbose: true
            }
        ));
        assert!(Cli::try_parse_from(["xtask", "build-kernels", "--check", "--force"]).is_err());
        let c = Cli::try_parse_from(["xtask", "pack-device", "-p", "a", "-p", "b", "--out", "x"])
            .expect("parse");
        assert!(
            matches!(c.command, Cmd::PackDevice { ref packages, .. } if packages == &["a", "b"])
        );
        let c =
            Cli::try_parse_from(["xtask", "test", "--", "--release", "-p", "x"]).expect("parse");
        assert!(
            matches!(c.command, Cmd::Test { ref cargo_args } if cargo_args == &["--release", "-p", "x"])
        );
        let c = Cli::try_parse_from(["xtask", "codegen", "--check"]).expect("parse");
        assert!(matches!(c.command, Cmd::Codegen { check: true }));
        let c = Cli::try_parse_from(["xtask", "bindgen-nvshmem", "--check"]).expect("parse");
        assert!(matches!(c.command, Cmd::BindgenNvshmem { check: true }));
        let c = Cli::try_parse_from(["xtask", "bindgen-nvshmem"]).expect("parse");
        assert!(matches!(c.command, Cmd::BindgenNvshmem { check: false }));
        let c = Cli::try_parse_from(["xtask", "wheel", "--test", "--install"]).expect("parse");
        assert!(matches!(
            c.command,
            Cmd::Wheel {
                check: false,
                test: true,
                install: true
            }
        ));
        assert!(Cli::try_parse_from(["xtask", "wheel", "--check", "--test"]).is_err());
    }
}
