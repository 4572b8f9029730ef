//! Runs the built `epcomm` binary: flag errors fail fast (before any worker is spawned),
//! `doctor`, `topo` and `plot` work without a GPU. `EPCOMM_BIN` overrides the binary (packed runs).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn bin() -> String {
    std::env::var("EPCOMM_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_epcomm").to_string())
}

/// Runs `epcomm args...` without the worker marker; returns the output and how long it took.
fn run(args: &[&str]) -> (Output, Duration) {
    run_in(std::path::Path::new("."), args)
}

/// [`run`] in directory `dir`.
fn run_in(dir: &std::path::Path, args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(bin())
        .current_dir(dir)
        .args(args)
        .env_remove("EPCOMM_WORKER")
        .env_remove("EPCOMM_CLI_RESULTS")
        .output()
        .expect("run the epcomm binary");
    (out, start.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[test]
fn bad_flags_fail_fast_naming_the_flag_without_spawning_workers() {
    for (args, flag, code) in [
        (&["bench", "--world", "2", "--iters", "0"][..], "--iters", 2),
        (
            &["bench", "--world", "2", "--experts", "255"],
            "--experts",
            2,
        ),
        (&["bench", "--world", "2", "--hidden", "100"], "--hidden", 2),
        (&["bench", "--world", "2", "--top-k", "300"], "--top-k", 2),
        (
            &["bench", "--world", "2", "--tokens", "2000000000"],
            "--tokens",
            2,
        ),
        (
            &["bench", "--world", "2", "--barrier", "peer-signal"],
            "--barrier",
            2,
        ),
        (
            &["bench", "--world", "2", "--virtual-nodes", "2"],
            "--virtual-nodes",
            2,
        ),
        (
            &["bench", "--world", "2", "--routes", "put-signal"],
            "--routes",
            2,
        ),
        (
            &["bench", "--world", "4", "--transport", "nvshmem:vnodes=3"],
            "--transport",
            2,
        ),
        (&["bench", "--schedule", "peer-signal"], "--schedule", 2),
        // Low-latency tokens past the routing bitmaps of this shape: before any GPU check.
        (
            &["bench", "--low-latency", "--tokens", "4096"],
            "--tokens 4096: must be at most 992",
            2,
        ),
        (
            &["bench", "--low-latency", "--world", "2", "--tokens", "993"],
            "--tokens 993: must be at most 992",
            2,
        ),
        // A negative count is a rule in words, not the integer parser's complaint.
        (&["bench", "--tokens", "-1"], "whole number", 2),
        (
            &["bench", "--world", "2", "--delay-rank", "2"],
            "--delay-rank",
            2,
        ),
        (
            &["bench", "--world", "2", "--sweep-sms", "0,24"],
            "--sweep-sms",
            2,
        ),
        (&["bench", "--world", "0"], "--world", 2),
        (&["bench", "--transport", "tcp"], "--transport", 2),
        (&["bench", "--json", "--csv"], "--csv", 2),
        (&["bench", "--plot", "x.svg"], "--sweep-sms", 2),
        // The internode bench needs more than one logical node.
        (
            &["bench", "--world", "2", "--hierarchical"],
            "--hierarchical",
            2,
        ),
        (
            &[
                "bench",
                "--world",
                "4",
                "--hierarchical",
                "--transport",
                "nvshmem",
            ],
            "vnodes=N",
            2,
        ),
        (
            &[
                "bench",
                "--world",
                "2",
                "--hierarchical",
                "--transport",
                "nvshmem:vnodes=2",
                "--sweep-sms",
                "16,24",
            ],
            "--sweep-sms",
            2,
        ),
        (
            &[
                "bench",
                "--world",
                "2",
                "--hierarchical",
                "--transport",
                "nvshmem:vnodes=2",
                "--low-latency",
            ],
            "--low-latency",
            2,
        ),
    ] {
        let (out, took) = run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} should name {flag}: {err}");
        // Nothing was started: no launch line, and no worker reported a missing driver.
        assert!(!err.contains("launching"), "{args:?}: {err}");
        assert!(!err.contains("no CUDA driver"), "{args:?}: {err}");
        assert!(!err.contains("worker"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: stdout must stay empty");
        assert!(took < Duration::from_secs(20), "{args:?} took {took:?}");
    }
}

#[test]
fn bench_without_a_driver_says_so() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let (out, _) = run(&["bench", "--world", "1", "--iters", "1"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("no CUDA driver"), "{err}");
    assert!(!err.contains("launching"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn doctor_reports_and_exits_zero() {
    let (out, _) = run(&["doctor"]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for section in [
        "CUDA driver",
        "GPUs",
        "Libraries",
        "NVSHMEM",
        "Environment",
        "Verdicts",
    ] {
        assert!(stdout.contains(section), "missing {section}: {stdout}");
    }
    if !driver_present() {
        assert!(stdout.contains("no CUDA driver"), "{stdout}");
        for spec in ["ipc", "nvshmem", "proxy-ce", "proxy-verbs"] {
            let line = format!("{spec:<8} not usable: no CUDA driver");
            assert!(stdout.contains(&line), "{line}: {stdout}");
        }
        // --require turns an unusable transport spec into exit code 4.
        for spec in ["ipc", "nvshmem:vnodes=2"] {
            let (out, _) = run(&["doctor", "--require", spec]);
            assert_eq!(out.status.code(), Some(4));
            let err = text(&out.stderr);
            assert!(
                err.contains(&format!("{spec}: not usable: no CUDA driver")),
                "{err}"
            );
        }
    }
    let (out, _) = run(&["doctor", "--require", "tcp"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--require"));
    let (out, _) = run(&["doctor", "--json"]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json");
    // One per backend: ipc, nvshmem, proxy-ce, proxy-verbs.
    assert_eq!(v["verdicts"].as_array().map(Vec::len), Some(4));
    assert!(v["driver"]["present"].is_boolean());
}

#[test]
fn topo_prints_the_library_route_plan() {
    let (out, _) = run(&[
        "topo",
        "--world",
        "4",
        "--gpus-per-node",
        "2",
        "--transport",
        "nvshmem",
    ]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        stdout.contains("world: 4 rank(s) = 2 node(s) x 2 local rank(s) (2 host(s))"),
        "{stdout}"
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() >= 3 && w[0].parse::<usize>().is_ok())
        .collect();
    let expect = [
        ("0", "this rank", "store"),
        ("1", "NVLink domain", "store"),
        ("2", "other node", "put-signal"),
        ("3", "other node", "put-signal"),
    ];
    assert_eq!(rows.len(), 4, "{stdout}");
    for (row, (peer, tier, route)) in rows.iter().zip(expect) {
        let line = row.join(" ");
        assert_eq!(row[0], peer, "{line}");
        assert!(line.contains(tier), "{line}");
        assert_eq!(row.last().copied(), Some(route), "{line}");
    }
    assert!(stdout.contains("put-signal mask: 0xc"), "{stdout}");

    // Two hosts: ipc (the default transport) cannot span them; the library says why.
    for (args, flag) in [
        (
            &["topo", "--world", "4", "--gpus-per-node", "2"][..],
            "--transport",
        ),
        (
            &["topo", "--world", "4", "--gpus-per-node", "3"],
            "--gpus-per-node",
        ),
    ] {
        let (out, _) = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn plot_draws_a_saved_sweep_and_names_a_bad_field() {
    let dir = std::env::temp_dir().join(format!("epcomm-cli-plot-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let run_json = dir.join("run.json");
    let doc = |time: &str| {
        format!(
            r#"{{"schema":"epcomm-bench/2","config":{{"world":2,"transport":"ipc",
            "schedule":"epoch","tokens":4096,"hidden":7168}},"results":[
            {{"op":"dispatch_bf16","sms":8,"time_us":300.0}},
            {{"op":"dispatch_bf16","sms":24,"time_us":{time}}}]}}"#
        )
    };
    std::fs::write(&run_json, doc("130.0")).expect("write");
    // By default the chart goes to the current directory, not next to the document.
    let cwd = dir.join("cwd");
    std::fs::create_dir_all(&cwd).expect("temp dir");
    let (out, _) = run_in(&cwd, &["plot", run_json.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(!dir.join("run.svg").exists(), "written next to the input");
    let svg = std::fs::read_to_string(cwd.join("run.svg")).expect("run.svg written");
    assert!(
        svg.starts_with("<svg") && svg.contains("dispatch BF16"),
        "{svg}"
    );

    std::fs::write(&run_json, doc("-1")).expect("write");
    let (out, _) = run(&["plot", run_json.to_str().expect("utf-8"), "-o", "/dev/null"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("epcomm plot: failed:") && stderr.contains("results[1].time_us"),
        "{stderr}"
    );
    let (out, _) = run(&[
        "plot",
        run_json.to_str().expect("utf-8"),
        "--metric",
        "gbps",
    ]);
    assert!(text(&out.stderr).contains("results[0].gbps is missing"));
    let _ = std::fs::remove_dir_all(&dir);
}
