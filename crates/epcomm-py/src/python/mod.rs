//! The PyO3 module `epcomm._native`: the [`Session`](crate::Session) classes (`session`), the
//! error conversion (`convert`) and the functions below, which need no GPU: build facts,
//! option checks, transport specs and the benchmark workload; and the row-format constant
//! `FP8_BLOCK` (values per FP8 scale).
//!
//! The module is private to the `epcomm` package; its Python API is `epcomm` (python/).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

mod convert;
mod session;

use convert::to_pyerr;

use epcomm_backends::{TransportError, TransportSpec};
use epcomm_topology::{BufferPlan, RoutePolicy, TopologyError};

use crate::error::BindError;
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
    epcomm_backends::forms()
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

/// The most tokens per rank whose normal-mode memory fits `budget_bytes` per rank
/// ([`epcomm::rules::max_tokens_for_budget`]); raises `InvalidArgumentError` naming
/// `budget_bytes` (or the shape's argument) otherwise.
#[pyfunction]
fn max_tokens_for_budget(
    py: Python<'_>,
    budget_bytes: u64,
    world_size: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
) -> PyResult<usize> {
    epcomm::rules::max_tokens_for_budget(budget_bytes, world_size, hidden, top_k, num_experts)
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
/// from `rank`) without a GPU, by the rules `Buffer::new` runs before it touches the device
/// (`epcomm::rules`); returns `{symmetric_bytes, capacity, transport, low_latency_bytes}` or
/// raises `InvalidArgumentError` naming the first broken rule's argument, its message listing
/// every broken rule.
#[pyfunction]
#[pyo3(signature = (max_tokens_per_rank, hidden, top_k, num_experts, num_sms, transport,
                    schedule, routes, timeout, world_size, rank, local_world_size,
                    ll_max_tokens_per_rank=0, ll_masking=false, two_tier=false))]
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
    ll_masking: bool,
    two_tier: bool,
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
        ll_masking,
        two_tier,
    };
    let (cfg, spec, plan) =
        resolve(&options, world_size, rank, local_world_size).map_err(|e| to_pyerr(py, e))?;
    let ll_bytes =
        crate::options::low_latency_bytes(&cfg, world_size).map_err(|e| to_pyerr(py, e))?;
    let d = PyDict::new(py);
    d.set_item("symmetric_bytes", plan.total_bytes())?;
    d.set_item("capacity", plan.recv_rows())?;
    d.set_item("transport", spec.to_string())?;
    d.set_item("low_latency_bytes", ll_bytes)?;
    Ok(d)
}

/// The config, the spec and the buffer plan of `options`, every device-free rule of
/// `Buffer::new` checked (`epcomm::rules::broken_rules`, the same function `Buffer::new`
/// runs).
///
/// # Errors
/// The options' own errors (a name, a field, the world layout: `transport` named for a
/// transport option such as `vnodes`); else [`BindError::InvalidArgument`] naming the first
/// broken rule's argument by its Python name, its rule followed by every other broken rule.
fn resolve(
    options: &BufferOptions,
    world_size: usize,
    rank: usize,
    local_world_size: usize,
) -> Result<(epcomm::BufferConfig, TransportSpec, BufferPlan), BindError> {
    let cfg = options.config()?;
    let spec = options.spec()?;
    let caps = spec.capabilities();
    let layout = spec
        .world_layout(world_size, rank, local_world_size)
        .map_err(|e| match e {
            // A backend's option struct (`NvshmemOptions::virtual_nodes`) is no argument of
            // Python's: the transport spec chose it.
            TransportError::InvalidArgument { argument, rule } if argument.contains("::") => {
                BindError::InvalidArgument {
                    argument: "transport",
                    rule: format!("{spec}: {rule}"),
                }
            }
            other => other.into(),
        })?;
    let broken = epcomm::rules::broken_rules(&cfg, world_size, &layout, &caps);
    if let Some(first) = broken.first() {
        let (argument, first_rule) = python_rule(first, &cfg);
        let others: Vec<String> = broken[1..]
            .iter()
            .map(|e| {
                let (a, r) = python_rule(e, &cfg);
                format!("invalid {a}: {r}")
            })
            .collect();
        let rule = std::iter::once(first_rule)
            .chain(others)
            .collect::<Vec<_>>()
            .join("; ");
        return Err(BindError::InvalidArgument { argument, rule });
    }
    // The plan `Buffer::new` allocates: the library's own function, not a copy.
    let plan = epcomm::rules::plan(&cfg, world_size)?;
    Ok((cfg, spec, plan))
}

/// A broken rule of `epcomm::rules` as Python names it: the argument (the low-latency token
/// count by its DeepEP name; a route the transport cannot take by `routes`, or by `transport`
/// under automatic routes) and the rule.
fn python_rule(e: &epcomm::Error, cfg: &epcomm::BufferConfig) -> (&'static str, String) {
    use epcomm::Error as E;
    match e {
        E::InvalidArgument {
            argument: "ll_max_tokens_per_rank",
            rule,
        } => ("num_max_dispatch_tokens_per_rank", rule.clone()),
        E::InvalidArgument { argument, rule } => (argument, rule.clone()),
        E::Transport(TransportError::InvalidArgument { argument, rule }) => {
            (argument, rule.clone())
        }
        E::Topology(t @ TopologyError::Unreachable { .. }) => {
            let argument = match cfg.routes {
                RoutePolicy::Auto => "transport",
                _ => "routes",
            };
            (argument, t.to_string())
        }
        other => ("options", other.to_string()),
    }
}

/// None when the `nvshmem` transports can run here (the backend's own probe: its host
/// library loads), else why not, naming every place that was tried.
#[pyfunction]
fn nvshmem_status(py: Python<'_>) -> Option<String> {
    py.detach(|| match "nvshmem".parse::<TransportSpec>() {
        Ok(spec) => spec.probe_here().err().map(|e| e.to_string()),
        Err(e) => Some(e.to_string()),
    })
}

/// Variables a one-host job needs that the environment does not set yet: `local_ranks` ranks
/// on this host, `ranks_per_gpu` of them sharing each GPU (default: one rank, its own GPU).
#[pyfunction]
#[pyo3(signature = (ranks_per_gpu = 1, local_ranks = 1))]
fn single_host_env_defaults(
    ranks_per_gpu: usize,
    local_ranks: usize,
) -> Vec<(&'static str, String)> {
    epcomm_backends::single_host_env_defaults(ranks_per_gpu, local_ranks)
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
    m.add_function(wrap_pyfunction!(max_tokens_for_budget, m)?)?;
    m.add_function(wrap_pyfunction!(single_host_env_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_status, m)?)?;
    m.add_function(wrap_pyfunction!(deepep_workload, m)?)?;
    // Values per FP8 scale of a token row (`epcomm_topology::RowFormat::FP8_BLOCK`, the block
    // of the buffer plans and kernels): the Python argument rules use this one.
    m.add("FP8_BLOCK", epcomm_topology::RowFormat::FP8_BLOCK)?;
    Ok(())
}
