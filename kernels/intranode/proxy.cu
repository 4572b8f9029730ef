// Image `intranode_proxy.fatbin`: peers whose bit is set in OpArgs::remote_mask are reached
// through this rank's CPU proxy (descriptors in a host-mapped ring, common/net_proxy.cuh),
// every other peer through a mapping of its buffer. The host writes the module global
// `epcomm_proxy_channel` once per buffer, before the first launch.
#include "common/net_proxy.cuh"
#include "intranode/kernels.cuh"
#include "ll/kernels.cuh"

EPCOMM_INTRANODE_KERNELS(epcomm::ProxyNet)
EPCOMM_LL_KERNELS(epcomm::ProxyNet)
