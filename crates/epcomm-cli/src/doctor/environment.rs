//! The environment: the variables that matter to epcomm, NVSHMEM, NCCL and CUDA, and the
//! warnings about them.
//!
//! Contract: pure functions of the variables given (the caller reads the process's).

/// The variables that matter to epcomm, NVSHMEM, NCCL and CUDA, sorted by name.
pub fn relevant_env(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    const EXACT: [&str; 4] = [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "LD_LIBRARY_PATH",
    ];
    const PREFIXES: [&str; 4] = ["EPCOMM_", "NVSHMEM_", "NCCL_", "CUDA_MPS_"];
    let mut v: Vec<(String, String)> = vars
        .filter(|(k, _)| EXACT.contains(&k.as_str()) || PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    v.sort();
    v
}

/// Warnings about the environment (pure). `gpus`: the GPUs this machine shows; the NVLink
/// multicast warnings are about GPUs, so a machine without any gets none.
pub fn env_warnings(env: &[(String, String)], gpus: usize) -> Vec<String> {
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut w = Vec::new();
    let shown = |v: Option<&str>| match v {
        None => "unset".to_string(),
        Some(v) => format!("{v:?}"),
    };
    let nvls = get("NVSHMEM_DISABLE_NVLS");
    if gpus > 0 && nvls != Some("1") {
        w.push(format!(
            "NVSHMEM_DISABLE_NVLS is {}: NVSHMEM may use NVLink multicast (NVLS), which can take a \
             shared host down; export NVSHMEM_DISABLE_NVLS=1 (`epcomm bench` sets it for its own \
             workers)",
            shown(nvls)
        ));
    }
    let nccl = get("NCCL_NVLS_ENABLE");
    if gpus > 0 && nccl != Some("0") {
        w.push(format!(
            "NCCL_NVLS_ENABLE is {}: NCCL may use NVLink multicast (NVLS); export \
             NCCL_NVLS_ENABLE=0",
            shown(nccl)
        ));
    }
    if let Some(v) = get("CUDA_DEVICE_MAX_CONNECTIONS")
        && v.trim().parse::<usize>().is_ok_and(|n| n < 32)
    {
        w.push(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS is {v:?}: the copy-engine proxy (proxy-ce) needs a \
             hardware queue per peer it copies to, one for its progress writes and one for the \
             kernel, or a copy can wait behind the kernel that waits for it; the transport \
             refuses too few. `epcomm bench` sets 32 for its own workers when it is unset \
             (with more than two ranks per GPU under MPS, 64 divided among them, at least the \
             ranks plus one), so a smaller value is expected only there"
        ));
    }
    if get("CUDA_VISIBLE_DEVICES") == Some("") {
        w.push("CUDA_VISIBLE_DEVICES is set but empty: it hides every GPU".into());
    }
    if get(epcomm_check::procs::WORKER_ENV).is_some() {
        w.push(format!(
            "{} is set: it makes `epcomm bench` act as one of its own workers; unset it",
            epcomm_check::procs::WORKER_ENV
        ));
    }
    w
}

/// This process's environment, lossily as UTF-8.
pub fn process_vars() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os().map(|(k, v)| {
        (
            k.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_hardware_queues_are_named() {
        let env = |v: &str| vec![("CUDA_DEVICE_MAX_CONNECTIONS".to_string(), v.to_string())];
        let w = env_warnings(&env("4"), 1);
        assert!(
            w.iter()
                .any(|m| m.contains("CUDA_DEVICE_MAX_CONNECTIONS is \"4\"")),
            "{w:?}"
        );
        let w = env_warnings(&env("32"), 1);
        assert!(
            !w.iter().any(|m| m.contains("CUDA_DEVICE_MAX_CONNECTIONS")),
            "{w:?}"
        );
        let kept = relevant_env(
            [
                ("CUDA_DEVICE_MAX_CONNECTIONS".to_string(), "32".to_string()),
                (
                    "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                    "/tmp/mps".to_string(),
                ),
                ("HOME".to_string(), "/root".to_string()),
            ]
            .into_iter(),
        );
        assert_eq!(kept.len(), 2, "{kept:?}");
    }

    #[test]
    fn nvls_warnings() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let w = env_warnings(&env(&[]), 1);
        assert!(
            w.iter()
                .any(|w| w.starts_with("NVSHMEM_DISABLE_NVLS is unset"))
        );
        assert!(w.iter().any(|w| w.starts_with("NCCL_NVLS_ENABLE is unset")));
        // No GPU: nothing to say about NVLink multicast.
        assert!(env_warnings(&env(&[]), 0).is_empty());
        let w = env_warnings(
            &env(&[("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0")]),
            1,
        );
        assert!(w.is_empty(), "{w:?}");
        let w = env_warnings(
            &env(&[
                ("NVSHMEM_DISABLE_NVLS", "0"),
                ("NCCL_NVLS_ENABLE", "1"),
                ("CUDA_VISIBLE_DEVICES", ""),
            ]),
            1,
        );
        assert_eq!(w.len(), 3, "{w:?}");
        let picked = relevant_env(
            env(&[
                ("PATH", "/bin"),
                ("NCCL_DEBUG", "INFO"),
                ("EPCOMM_X", "1"),
                ("CUDA_VISIBLE_DEVICES", "0,1"),
                ("LD_LIBRARY_PATH", "/l"),
                ("HOME", "/h"),
            ])
            .into_iter(),
        );
        let names: Vec<&str> = picked.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "CUDA_VISIBLE_DEVICES",
                "EPCOMM_X",
                "LD_LIBRARY_PATH",
                "NCCL_DEBUG"
            ]
        );
    }
}
