//! [`VerbsOptions`] and [`GpuRegistration`]: how the transport is set up, from code or the
//! environment.

use super::*;

/// How GPU memory (the symmetric buffer, and caller arrays the kernels put from) is registered
/// with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GpuRegistration {
    /// [`GpuRegistration::DmaBuf`] where the CUDA driver and libibverbs support it, else
    /// [`GpuRegistration::PeerMemory`].
    #[default]
    Auto,
    /// A dma-buf of the range (`cuMemGetHandleForAddressRange`, then `ibv_reg_dmabuf_mr`):
    /// needs `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (driver and kernel) and rdma-core 34 or
    /// newer.
    DmaBuf,
    /// The address range (`ibv_reg_mr`): needs the `nvidia-peermem` kernel module.
    PeerMemory,
}

impl GpuRegistration {
    /// The spellings of `EPCOMM_VERBS_REGISTRATION`, in variant order.
    pub const NAMES: [&'static str; 3] = ["auto", "dmabuf", "peermem"];

    /// Its spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => Self::NAMES[0],
            Self::DmaBuf => Self::NAMES[1],
            Self::PeerMemory => Self::NAMES[2],
        }
    }
}

/// How the `proxy-verbs` transport is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsOptions {
    /// The ring and proxy thread, as for `proxy-ce` (`virtual_nodes`, `ring_slots`,
    /// `max_in_flight`, the two bounds, `cpu`, `trace`). `mirror_progress`, `batch_copies`,
    /// `copy_queue_depth`, `copy_linger` and `copy_query_interval` are copy-engine settings
    /// and are not used here.
    pub proxy: ProxyOptions,
    /// How GPU memory is registered with the NIC.
    pub registration: GpuRegistration,
    /// Which RDMA device (default: the first with an active port; see `nearest_to_gpu`).
    pub device: DeviceSelector,
    /// With `device` [`DeviceSelector::FirstActive`]: when the transport is built, take the
    /// active device nearest this rank's GPU in the PCI tree instead
    /// ([`DeviceSelector::NearestTo`] its bus id), so that each GPU of a host with a NIC per
    /// GPU gets its own. Default true; the check before the GPU is known
    /// ([`super::VerbsTransport::preflight`]) looks for any active device.
    pub nearest_to_gpu: bool,
    /// Which port (`None`: the device's first active one).
    pub port: Option<u8>,
    /// Which GID (default: the first RoCE v2 GID; index 0 on InfiniBand).
    pub gid: GidSelector,
    /// Work requests in flight per peer; a full send queue makes the proxy wait.
    pub send_queue_depth: u32,
    /// Where libibverbs is looked for (`EPCOMM_IBVERBS_LIB`, then the system's loader).
    pub library: LibrarySearch,
}

impl VerbsOptions {
    /// Defaults for `local_world_size` ranks per host: [`ProxyOptions::one_node_per_rank`]
    /// (every peer through the NIC), [`GpuRegistration::Auto`], the active device nearest the
    /// GPU (else the first active one) and its first active port, the RoCE v2 GID, 256 work
    /// requests per send queue.
    pub fn one_node_per_rank(local_world_size: usize) -> Self {
        Self {
            proxy: ProxyOptions::one_node_per_rank(local_world_size),
            registration: GpuRegistration::Auto,
            device: DeviceSelector::FirstActive,
            nearest_to_gpu: true,
            port: None,
            gid: GidSelector::RoceV2,
            send_queue_depth: 256,
            library: LibrarySearch::from_env(),
        }
    }

    /// [`Self::one_node_per_rank`] with [`ProxyOptions::from_env`]'s variables and
    /// `EPCOMM_VERBS_DEVICE` (a device name), `EPCOMM_VERBS_PORT` (1..=255),
    /// `EPCOMM_VERBS_GID_INDEX` (0..=255), `EPCOMM_VERBS_REGISTRATION`
    /// (`auto`, `dmabuf`, `peermem`) when set.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the variable whose value breaks its rule.
    pub fn from_env(local_world_size: usize) -> Result<Self, TransportError> {
        let mut options = Self::from_lookup(local_world_size, |k| std::env::var(k).ok())?;
        options.proxy = ProxyOptions::from_env(local_world_size)?;
        Ok(options)
    }

    /// [`Self::one_node_per_rank`] with the `EPCOMM_VERBS_*` variables read through
    /// `lookup` (the proxy's own variables are [`ProxyOptions::from_env`]'s).
    ///
    /// # Errors
    /// As [`Self::from_env`].
    pub fn from_lookup(
        local_world_size: usize,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TransportError> {
        let mut options = Self::one_node_per_rank(local_world_size);
        let number = |name: &'static str, min: u8| -> Result<Option<u8>, TransportError> {
            match lookup(name) {
                None => Ok(None),
                Some(v) => match v.trim().parse::<u8>() {
                    Ok(n) if n >= min => Ok(Some(n)),
                    _ => Err(TransportError::InvalidArgument {
                        argument: name,
                        rule: format!("must be an integer in {min}..=255 (got {v:?})"),
                    }),
                },
            }
        };
        if let Some(name) = lookup("EPCOMM_VERBS_DEVICE") {
            let name = name.trim();
            if name.is_empty() {
                return Err(TransportError::InvalidArgument {
                    argument: "EPCOMM_VERBS_DEVICE",
                    rule: "must name an RDMA device (`mlx5_0`, `rxe0`) when set".into(),
                });
            }
            options.device = DeviceSelector::Name(name.to_string());
        }
        options.port = number("EPCOMM_VERBS_PORT", 1)?;
        if let Some(i) = number("EPCOMM_VERBS_GID_INDEX", 0)? {
            options.gid = GidSelector::Index(i);
        }
        if let Some(v) = lookup("EPCOMM_VERBS_REGISTRATION") {
            let i = parse_choice("EPCOMM_VERBS_REGISTRATION", &v, &GpuRegistration::NAMES)?;
            options.registration = match i {
                Some(1) => GpuRegistration::DmaBuf,
                Some(2) => GpuRegistration::PeerMemory,
                _ => GpuRegistration::Auto,
            };
        }
        Ok(options)
    }

    /// Checks every rule (no GPU, no device needed).
    ///
    /// # Errors
    /// [`ProxyOptions::validate`]'s; [`TransportError::InvalidArgument`] naming
    /// `VerbsOptions::send_queue_depth` unless it is above zero, or `VerbsOptions::port`
    /// when it is 0 (ports are numbered from 1).
    pub fn validate(&self) -> Result<(), TransportError> {
        self.proxy.validate()?;
        if self.send_queue_depth == 0 {
            return Err(TransportError::InvalidArgument {
                argument: "VerbsOptions::send_queue_depth",
                rule: "must be > 0".into(),
            });
        }
        if self.port == Some(0) {
            return Err(TransportError::InvalidArgument {
                argument: "VerbsOptions::port",
                rule: "ports are numbered from 1".into(),
            });
        }
        Ok(())
    }
}
