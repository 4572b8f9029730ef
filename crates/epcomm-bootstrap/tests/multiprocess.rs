//! Multi-process tests over 127.0.0.1.
//!
//! Each test re-executes this test binary as N worker processes (`<test name> --exact`) with
//! [`WORKER_ENV`] set; the same test function then acts as a worker instead of a launcher. A
//! worker signals failure by panicking (non-zero exit), which the launcher reports with the
//! worker's captured output.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use epcomm_bootstrap::launch::{LocalLaunch, Output};
use epcomm_bootstrap::{
    Bootstrap, BootstrapConfig, BootstrapError, CRATE_VERSION, Identity, Liveness, OpKind,
    TIMEOUT_ENV,
};

/// Marks a process as a worker.
const WORKER_ENV: &str = "EPCOMM_BOOTSTRAP_TEST_WORKER";
/// Makes a worker advertise this crate version instead of the real one.
const FAKE_VERSION_ENV: &str = "EPCOMM_BOOTSTRAP_TEST_FAKE_VERSION";
/// Bootstrap timeout of the workers.
const TIMEOUT: Duration = Duration::from_millis(2000);

fn is_worker() -> bool {
    std::env::var_os(WORKER_ENV).is_some()
}

/// Runs test `name` as `world` worker processes and fails with their output if any fails.
fn launch(name: &str, world: usize, tweak: impl FnOnce(LocalLaunch) -> LocalLaunch) {
    let exe = std::env::current_exe().expect("current_exe");
    let launch = LocalLaunch::new(exe, [name, "--exact", "--nocapture", "--test-threads", "1"])
        .world_size(world)
        .env(WORKER_ENV, "1")
        .env(
            "EPCOMM_BOOTSTRAP_TIMEOUT_MS",
            TIMEOUT.as_millis().to_string(),
        )
        .env("RUST_BACKTRACE", "1")
        .output(Output::Capture);
    let mut group = tweak(launch).spawn().expect("spawn workers");
    let result = group.wait(Duration::from_secs(30));
    if let Err(e) = result {
        let mut report = format!("{name}: {e}\n");
        for o in group.output() {
            report.push_str(&format!(
                "=== rank {} stdout ===\n{}\n=== rank {} stderr ===\n{}\n",
                o.rank,
                String::from_utf8_lossy(&o.stdout),
                o.rank,
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        panic!("{report}");
    }
}

fn worker_config() -> BootstrapConfig {
    let cfg = BootstrapConfig::from_env().expect("worker environment");
    assert_eq!(cfg.timeout, TIMEOUT);
    cfg
}

/// This worker's identity: the crate's, with the version `FAKE_VERSION_ENV` names if set.
fn worker_identity() -> Identity {
    match std::env::var(FAKE_VERSION_ENV) {
        Ok(v) => Identity {
            crate_version: v,
            ..Identity::current()
        },
        Err(_) => Identity::current(),
    }
}

fn connect_worker() -> Bootstrap {
    Bootstrap::connect_with_identity(worker_config(), worker_identity()).expect("connect")
}

#[test]
fn collectives_across_four_processes() {
    if !is_worker() {
        return launch("collectives_across_four_processes", 4, |l| l);
    }
    let bs = connect_worker();
    let (rank, world) = (bs.rank(), bs.world_size());
    assert_eq!(world, 4);
    assert_eq!(bs.local_rank(), rank);
    assert_eq!(bs.local_world_size(), 4);
    for round in 0..6usize {
        if round % 2 == 1 {
            // Skew the ranks so fast ones run ahead into the next op with the same tags.
            std::thread::sleep(Duration::from_millis(15 * rank as u64));
        }
        let mine = vec![(rank * 10 + round) as u8; rank + round];
        let all = bs.all_gather("gather", &mine).expect("all_gather");
        assert_eq!(all.len(), world);
        for (r, d) in all.iter().enumerate() {
            assert_eq!(
                d,
                &vec![(r * 10 + round) as u8; r + round],
                "round {round} rank {r}"
            );
        }
        let root = round % world;
        let msg = format!("round {round} from root {root}");
        let got = bs
            .broadcast("bcast", root, (rank == root).then_some(msg.as_bytes()))
            .expect("broadcast");
        assert_eq!(got, msg.as_bytes());
        bs.barrier("sync").expect("barrier");
    }
}

#[test]
fn rank_that_never_arrives_is_named_in_timeout() {
    if !is_worker() {
        return launch("rank_that_never_arrives_is_named_in_timeout", 3, |l| {
            l.ranks([0, 1])
        });
    }
    let start = Instant::now();
    let err = Bootstrap::connect(worker_config()).expect_err("rank 2 never arrives");
    let waited = start.elapsed();
    match err {
        BootstrapError::Timeout {
            op: OpKind::Connect,
            missing_ranks,
            ..
        } => {
            assert_eq!(missing_ranks, vec![2]);
        }
        other => panic!("expected a connect timeout naming rank 2, got {other}"),
    }
    assert!(waited >= TIMEOUT / 2, "gave up too early: {waited:?}");
    assert!(
        waited < TIMEOUT + Duration::from_millis(700),
        "exceeded the bound: {waited:?}"
    );
}

/// Worker side of a death test: after a first barrier, rank `dying` exits without a goodbye
/// (exit code 0 keeps the launcher from killing the survivors before they check their errors);
/// every other rank gets its bootstrap back and the time the death became possible.
fn survive_the_death_of(dying: usize) -> Option<(Bootstrap, Instant)> {
    let bs = connect_worker();
    bs.barrier("first").expect("first barrier");
    if bs.rank() == dying {
        std::process::exit(0);
    }
    Some((bs, Instant::now()))
}

/// Asserts that `result` is `PeerDied` naming `rank`, within half the timeout of `start`.
#[track_caller]
fn assert_died_promptly<T: std::fmt::Debug>(
    result: Result<T, BootstrapError>,
    rank: usize,
    op: OpKind,
    start: Instant,
) {
    match result {
        Err(BootstrapError::PeerDied { rank: r, op: o, .. }) if r == rank && o == op => {}
        other => panic!("expected PeerDied naming rank {rank} in {op:?}, got {other:?}"),
    }
    assert!(
        start.elapsed() < TIMEOUT / 2,
        "not prompt: {:?}",
        start.elapsed()
    );
}

#[test]
fn rank_that_dies_is_reported_promptly() {
    if !is_worker() {
        return launch("rank_that_dies_is_reported_promptly", 3, |l| l);
    }
    let Some((bs, start)) = survive_the_death_of(2) else {
        return;
    };
    assert_died_promptly(bs.barrier("second"), 2, OpKind::Barrier, start);
    assert_died_promptly(bs.all_gather("third", b"x"), 2, OpKind::AllGather, start);
}

#[test]
fn coordinator_death_is_reported_promptly() {
    if !is_worker() {
        return launch("coordinator_death_is_reported_promptly", 3, |l| l);
    }
    let Some((bs, start)) = survive_the_death_of(0) else {
        return;
    };
    assert_died_promptly(
        bs.all_gather("after", &[1, 2, 3]),
        0,
        OpKind::AllGather,
        start,
    );
}

#[test]
fn world_size_mismatch_is_rejected_everywhere() {
    if !is_worker() {
        return launch("world_size_mismatch_is_rejected_everywhere", 2, |l| {
            l.rank_env(1, "WORLD_SIZE", "3")
        });
    }
    match Bootstrap::connect(worker_config()).expect_err("world sizes differ") {
        BootstrapError::WorldSizeMismatch {
            coordinator: 2,
            peer: 3,
            peer_rank: 1,
        } => {}
        other => panic!("expected WorldSizeMismatch 2 vs 3 from rank 1, got {other}"),
    }
}

#[test]
fn crate_version_mismatch_is_rejected_everywhere() {
    if !is_worker() {
        return launch("crate_version_mismatch_is_rejected_everywhere", 2, |l| {
            l.rank_env(1, FAKE_VERSION_ENV, "99.0.0-test")
        });
    }
    match Bootstrap::connect_with_identity(worker_config(), worker_identity())
        .expect_err("versions differ")
    {
        BootstrapError::CrateVersionMismatch {
            coordinator,
            peer,
            peer_rank: 1,
        } => {
            assert_eq!(coordinator, CRATE_VERSION);
            assert_eq!(peer, "99.0.0-test");
        }
        other => panic!("expected CrateVersionMismatch from rank 1, got {other}"),
    }
}

/// Operation timeout of the freeze tests: far longer than any detection they accept.
const LONG_TIMEOUT: Duration = Duration::from_secs(120);
/// Directory where the survivors of a freeze test record that they have seen the error.
const MARKERS_ENV: &str = "EPCOMM_BOOTSTRAP_TEST_MARKERS";

/// A fresh directory for a freeze test's markers, removed when dropped (also on panic).
struct Markers(PathBuf);

impl Markers {
    fn new(test: &str) -> Markers {
        let dir = std::env::temp_dir().join(format!("{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create marker directory");
        Markers(dir)
    }
}

impl Drop for Markers {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid` through the shell's `kill` builtin;
/// false if it failed (e.g. the process has exited).
fn signal(pid: u32, signal: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("kill -{signal} {pid} 2>/dev/null")])
        .status()
        .expect("run sh")
        .success()
}

/// Worker body of the freeze tests: rank `frozen` stops itself with SIGSTOP (its sockets stay
/// open and its kernel keeps acknowledging, as for a hung process), the others run a barrier
/// with a 120 s timeout and must get `PeerUnresponsive` naming it within `bound`. The last
/// survivor to get its error then releases it (marker file, then SIGCONT) and it exits;
/// releasing it earlier would let a survivor still waiting see it die instead. If a survivor
/// fails, the launcher kills every rank, the stopped one included.
fn freeze_worker(frozen: usize, bound: Duration) {
    let cfg = BootstrapConfig::from_env().expect("worker environment");
    assert_eq!(cfg.timeout, LONG_TIMEOUT);
    let liveness = Liveness::from_env().expect("liveness environment");
    let bs = Bootstrap::connect(cfg).expect("connect");
    let pids = bs
        .all_gather("pids", &std::process::id().to_le_bytes())
        .expect("pid exchange");
    let pid = |r: usize| u32::from_le_bytes(pids[r].as_slice().try_into().expect("4-byte pid"));
    let markers = PathBuf::from(std::env::var_os(MARKERS_ENV).expect("marker directory"));
    let release = markers.join("release");
    if bs.rank() == frozen {
        assert!(signal(std::process::id(), "STOP"), "cannot stop myself");
        // A process-directed SIGSTOP stops a multi-threaded process asynchronously: this thread
        // may run on for a moment, so it waits for the release instead of assuming a resume.
        while !release.exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Released by a survivor: leave without a goodbye, like a process that was killed.
        std::process::exit(0);
    }
    let start = Instant::now();
    let err = bs.barrier("during-freeze").expect_err("a rank is frozen");
    let waited = start.elapsed();
    // Whichever survivor lists the markers last sees all of them, so someone releases it.
    std::fs::write(markers.join(format!("rank-{}", bs.rank())), b"").expect("write marker");
    let seen = std::fs::read_dir(&markers)
        .expect("list markers")
        .filter(|e| e.as_ref().is_ok_and(|e| e.file_name() != "release"))
        .count();
    if seen == bs.world_size() - 1 {
        std::fs::write(&release, b"").expect("write release marker");
        // Both survivors may get here; the second may find the released rank gone: fine.
        signal(pid(frozen), "CONT");
    }
    match err {
        BootstrapError::PeerUnresponsive {
            rank,
            op: OpKind::Barrier,
            tag,
            silent_for,
        } => {
            assert_eq!(rank, frozen);
            assert_eq!(tag, "during-freeze");
            assert!(
                silent_for >= liveness.peer_timeout,
                "declared after {silent_for:?} of silence, limit {:?}",
                liveness.peer_timeout
            );
        }
        other => panic!("expected PeerUnresponsive naming rank {frozen}, got {other}"),
    }
    assert!(waited < bound, "detected after {waited:?}, bound {bound:?}");
    eprintln!(
        "rank {}: frozen rank {frozen} detected after {waited:?}",
        bs.rank()
    );
}

#[test]
fn frozen_rank_is_named_within_seconds() {
    // Default liveness settings (5 s of silence): well under 10 s instead of 120 s.
    if !is_worker() {
        let markers = Markers::new("frozen_rank_is_named_within_seconds");
        return launch("frozen_rank_is_named_within_seconds", 3, |l| {
            l.env(TIMEOUT_ENV, LONG_TIMEOUT.as_millis().to_string())
                .env(MARKERS_ENV, &markers.0)
        });
    }
    assert_eq!(Liveness::from_env().unwrap(), Liveness::default());
    freeze_worker(2, Duration::from_secs(10));
}

#[test]
fn frozen_coordinator_is_named_within_seconds() {
    // Rank 0 hosts the coordinator: freezing it silences the whole rendezvous. The settings
    // come from the environment overrides.
    if !is_worker() {
        let markers = Markers::new("frozen_coordinator_is_named_within_seconds");
        return launch("frozen_coordinator_is_named_within_seconds", 3, |l| {
            l.env(TIMEOUT_ENV, LONG_TIMEOUT.as_millis().to_string())
                .env(Liveness::PEER_TIMEOUT_ENV, "1500")
                .env(Liveness::HEARTBEAT_ENV, "250")
                .env(MARKERS_ENV, &markers.0)
        });
    }
    let l = Liveness::from_env().unwrap();
    assert_eq!(
        (l.peer_timeout, l.heartbeat_interval),
        (Duration::from_millis(1500), Duration::from_millis(250))
    );
    freeze_worker(0, Duration::from_secs(5));
}

/// Marks the helper process of [`ranks_die_with_a_launcher_that_dies`].
const ORPHAN_HELPER_ENV: &str = "EPCOMM_BOOTSTRAP_TEST_ORPHAN_HELPER";

/// The launcher of [`ranks_die_with_a_launcher_that_dies`]: starts two ranks that would sleep
/// for a minute, prints their pids, and exits at once without dropping the group (as a killed
/// launcher would). Outside that test it does nothing.
#[test]
fn orphan_helper() {
    if std::env::var_os(ORPHAN_HELPER_ENV).is_none() {
        return;
    }
    let group = LocalLaunch::new("sh", ["-c", "sleep 60"])
        .world_size(2)
        .output(Output::Null)
        .spawn()
        .expect("spawn ranks");
    let pids: Vec<String> = group.pids().iter().map(u32::to_string).collect();
    println!("PIDS {}", pids.join(" "));
    std::process::exit(0);
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
#[cfg(target_os = "linux")]
fn is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// A launcher that dies without cleaning up takes its ranks with it (Linux): none keeps
/// running, holding a GPU, after `epcomm bench` or a test harness was killed.
#[cfg(target_os = "linux")]
#[test]
fn ranks_die_with_a_launcher_that_dies() {
    if is_worker() || std::env::var_os(ORPHAN_HELPER_ENV).is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(exe)
        .args([
            "orphan_helper",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ORPHAN_HELPER_ENV, "1")
        .output()
        .expect("run the helper launcher");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pids: Vec<u32> = stdout
        .lines()
        .find_map(|l| l.split_once("PIDS ").map(|(_, pids)| pids))
        .unwrap_or_else(|| panic!("the helper printed no pids: {stdout}"))
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(pids.len(), 2, "{stdout}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pids.iter().all(|&p| is_gone(p)) {
        assert!(
            Instant::now() < deadline,
            "ranks {pids:?} outlived their launcher by 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
