//! [`probe_rdma`] and the agreement on its outcome: what every rank checks, and agrees on,
//! before anything is allocated ([`Preflight`]).

use super::*;

/// What [`probe_rdma`] found: the device, port and GID the transport will use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaProbe {
    /// Where libibverbs was loaded from.
    pub library: PathBuf,
    /// The device (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Its active port.
    pub port: u8,
    /// The GID index.
    pub gid_index: u8,
    /// `"Ethernet"` (RoCE) or `"InfiniBand"`.
    pub link_layer: &'static str,
    /// Whether libibverbs can register dma-bufs (`ibv_reg_dmabuf_mr`).
    pub dmabuf: bool,
}

/// The first thing the transport does, on this rank alone and without a GPU: loads
/// libibverbs and selects the device, port and GID `options` ask for (the device is opened
/// and closed again).
///
/// # Errors
/// [`TransportError::Unavailable`] (`what`: `"proxy-verbs"`) when libibverbs is not found, when
/// the machine has no RDMA device (`no RDMA device: …`), no active port or no usable GID, or a
/// verbs call fails; [`TransportError::InvalidArgument`] naming `VerbsOptions::device` when
/// the device asked for does not exist.
pub fn probe_rdma(options: &VerbsOptions) -> Result<RdmaProbe, TransportError> {
    let verbs = Arc::new(Verbs::load(&options.library).map_err(|e| unavailable(e.to_string()))?);
    let selected = select::select(&verbs, &options.device, options.port, options.gid).map_err(
        |e| match e {
            VerbsError::DeviceNotFound { .. } => TransportError::InvalidArgument {
                argument: "VerbsOptions::device",
                rule: e.to_string(),
            },
            other => unavailable(other.to_string()),
        },
    )?;
    Ok(RdmaProbe {
        library: verbs.path().to_path_buf(),
        device: selected.context.name().to_string(),
        port: selected.port,
        gid_index: selected.gid_index,
        // enum ibv_link_layer: 2 is Ethernet; 1 (and 0, unspecified) InfiniBand.
        link_layer: if selected.port_attr.link_layer == 2 {
            "Ethernet"
        } else {
            "InfiniBand"
        },
        dmabuf: verbs.supports_dmabuf(),
    })
}

pub(super) fn unavailable(why: String) -> TransportError {
    TransportError::Unavailable { what: NAME, why }
}

/// An error known by its text only: what a peer reported instead of its part of a collective
/// step, or a failed driver call's description.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ErrorText(pub String);

/// Every rank's outcome of a local step, agreed over the bootstrap (`tag`): this rank's value
/// when every rank succeeded; this rank's own error when it failed; else `on_peer(rank,
/// message)` for the first rank that failed. Every rank takes part even after a local
/// failure, so none waits for a rank that gave up.
pub(super) fn agree<T>(
    bootstrap: &Bootstrap,
    tag: &str,
    local: Result<(T, Vec<u8>), TransportError>,
    on_peer: impl FnOnce(usize, String) -> TransportError,
) -> Result<(T, Vec<Vec<u8>>), TransportError> {
    let msg = match &local {
        Ok((_, payload)) => [&[0u8][..], payload].concat(),
        Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = bootstrap
        .all_gather(tag, &msg)
        .map_err(|source| TransportError::Bootstrap {
            context: format!("agreeing on the outcome of {tag}"),
            source,
        })?;
    let (value, _) = local?;
    let mut payloads = Vec::with_capacity(all.len());
    for (peer, m) in all.into_iter().enumerate() {
        match m.split_first() {
            Some((0, rest)) => payloads.push(rest.to_vec()),
            Some((_, text)) => {
                return Err(on_peer(peer, String::from_utf8_lossy(text).into_owned()));
            }
            None => {
                return Err(TransportError::BadPeerData {
                    peer,
                    what: "outcome",
                    detail: format!("an empty message for {tag}"),
                });
            }
        }
    }
    Ok((value, payloads))
}

/// [`probe_rdma`] on every rank of `bootstrap`, agreed (collective): what
/// [`VerbsTransport::new`] does first, before it touches the GPU.
///
/// # Errors
/// This rank's [`probe_rdma`] error; else [`TransportError::Unavailable`] naming the first
/// rank whose probe failed, with its reason; [`TransportError::Bootstrap`].
pub fn check_rdma(
    bootstrap: &Bootstrap,
    options: &VerbsOptions,
) -> Result<RdmaProbe, TransportError> {
    let local = probe_rdma(options).map(|p| (p, Vec::new()));
    agree(bootstrap, "proxy-verbs-probe", local, |peer, why| {
        unavailable(format!("rank {peer}: {why}"))
    })
    .map(|(probe, _)| probe)
}

/// What [`VerbsTransport::preflight`] checked: the layout, the options and the probe.
#[derive(Clone, Debug)]
pub struct Preflight {
    pub(super) world: WorldLayout,
    pub(super) options: VerbsOptions,
    pub(super) probe: RdmaProbe,
}

impl Preflight {
    /// What the probe found on this rank.
    pub fn probe(&self) -> &RdmaProbe {
        &self.probe
    }

    /// The world layout.
    pub fn world(&self) -> WorldLayout {
        self.world
    }
}
