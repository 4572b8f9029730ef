//! The PyO3 module `epcomm._native`: the [`Session`](crate::Session) classes (`session`), the
//! error conversion (`convert`) and the functions below, which need no GPU: build facts,
//! option checks, transport specs and the benchmark workload.
//!
//! The module is private to the `epcomm` package; its Python API is `epcomm` (python/).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

mod convert;
mod session;

use convert::to_pyerr;

use crate::options::BufferOptions;

/// The package version (the workspace's).
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Every kernel image of this build: `(name, artifact, embedded)`.
#[pyfunction]
fn kernel_images() -> Vec<(&'static str, &'static str, bool)> {
    epcomm_kernels::images()
        .map(|i| (i.name(), i.artifact(), i.is_embedded()))
        .collect()
}

/// Whether the CUDA driver library loads (nothing else is asked of the driver).
#[pyfunction]
fn driver_present() -> bool {
    // SAFETY: only tries to load the driver library; no preconditions.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The forms a transport spec can take.
#[pyfunction]
fn transport_forms() -> Vec<&'static str> {
    epcomm_backends::TransportSpec::FORMS.to_vec()
}

/// The canonical form of transport spec `spec`; raises `InvalidArgumentError` naming
/// `transport` when it is not one.
#[pyfunction]
fn parse_transport(py: Python<'_>, spec: &str) -> PyResult<String> {
    spec.trim()
        .parse::<epcomm_backends::TransportSpec>()
        .map(|s| s.to_string())
        .map_err(|e| to_pyerr(py, e.into()))
}

/// The schedule names.
#[pyfunction]
fn schedules() -> Vec<&'static str> {
    epcomm_topology::Schedule::ALL
        .iter()
        .map(|s| s.name())
        .collect()
}

/// The route policy names.
#[pyfunction]
fn route_policies() -> Vec<&'static str> {
    epcomm_topology::RoutePolicy::ALL
        .iter()
        .map(|r| r.name())
        .collect()
}

/// Checks a Buffer's arguments for `world_size` ranks (`local_world_size` per host, seen
/// from `rank`) without a GPU; returns `{symmetric_bytes, capacity, transport,
/// low_latency_bytes}` or raises the error `Buffer` would.
#[pyfunction]
#[pyo3(signature = (max_tokens_per_rank, hidden, top_k, num_experts, num_sms, transport,
                    schedule, routes, timeout, world_size, rank, local_world_size,
                    ll_max_tokens_per_rank=0))]
#[allow(clippy::too_many_arguments)]
fn check_options<'py>(
    py: Python<'py>,
    max_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
    num_sms: u32,
    transport: String,
    schedule: String,
    routes: String,
    timeout: f64,
    world_size: usize,
    rank: usize,
    local_world_size: usize,
    ll_max_tokens_per_rank: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let options = BufferOptions {
        max_tokens_per_rank,
        hidden,
        top_k,
        num_experts,
        num_sms,
        transport,
        schedule,
        routes,
        timeout_s: timeout,
        ll_max_tokens_per_rank,
    };
    let (cfg, spec, plan) = options
        .resolve(world_size, rank, local_world_size)
        .map_err(|e| to_pyerr(py, e))?;
    let ll_bytes =
        crate::options::low_latency_bytes(&cfg, world_size).map_err(|e| to_pyerr(py, e))?;
    let d = PyDict::new(py);
    d.set_item("symmetric_bytes", plan.total_bytes())?;
    d.set_item("capacity", plan.recv_rows())?;
    d.set_item("transport", spec.to_string())?;
    d.set_item("low_latency_bytes", ll_bytes)?;
    Ok(d)
}

/// None when the NVSHMEM host library (for the `nvshmem` transports) loads here, else why not,
/// naming every place that was tried.
#[pyfunction]
fn nvshmem_status(py: Python<'_>) -> Option<String> {
    py.detach(|| {
        nvshmem_sys::loader::load_default()
            .err()
            .map(|e| e.to_string())
    })
}

/// Variables a one-host job needs that the environment does not set yet, every rank on its
/// own GPU.
#[pyfunction]
fn single_host_env_defaults() -> Vec<(&'static str, String)> {
    epcomm_backends::single_host_env_defaults(1, 1)
}

/// Rank `rank`'s DeepEP workload exactly as `epcomm bench` makes it (`seed`, the run's seed),
/// as little-endian bytes: `{x, topk_idx, topk_weights, x_fp8, scales}`.
#[pyfunction]
fn deepep_workload<'py>(
    py: Python<'py>,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    experts: usize,
    seed: u64,
    rank: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let w = py
        .detach(|| crate::workload::deepep_workload(tokens, hidden, top_k, experts, seed, rank))
        .map_err(|e| to_pyerr(py, e))?;
    let d = PyDict::new(py);
    d.set_item("x", PyBytes::new(py, &w.x))?;
    d.set_item("topk_idx", PyBytes::new(py, &w.topk_idx))?;
    d.set_item("topk_weights", PyBytes::new(py, &w.topk_weights))?;
    d.set_item("x_fp8", PyBytes::new(py, &w.x_fp8))?;
    d.set_item("scales", PyBytes::new(py, &w.scales))?;
    Ok(d)
}

/// The native layer of the `epcomm` package (private: use `epcomm`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<session::PySession>()?;
    m.add_class::<session::PyLayout>()?;
    m.add_class::<session::PyHandle>()?;
    m.add_class::<session::PyDispatch>()?;
    m.add_class::<session::PyLlDispatch>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_images, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(transport_forms, m)?)?;
    m.add_function(wrap_pyfunction!(parse_transport, m)?)?;
    m.add_function(wrap_pyfunction!(schedules, m)?)?;
    m.add_function(wrap_pyfunction!(route_policies, m)?)?;
    m.add_function(wrap_pyfunction!(check_options, m)?)?;
    m.add_function(wrap_pyfunction!(single_host_env_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_status, m)?)?;
    m.add_function(wrap_pyfunction!(deepep_workload, m)?)?;
    Ok(())
}
