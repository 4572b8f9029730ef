// Image `intranode_nvshmem.cubin` (device-linked with libnvshmem_device and registered with
// nvshmemx_cumodule_init after NVSHMEM is initialised): peers whose bit is set in
// OpArgs::remote_mask are reached with NVSHMEM put/signal, every other peer through its
// `nvshmem_ptr` mapping.
#include "common/net_nvshmem.cuh"
#include "intranode/kernels.cuh"
#include "ll/kernels.cuh"

EPCOMM_INTRANODE_KERNELS(epcomm::NvshmemNet)
EPCOMM_LL_KERNELS(epcomm::NvshmemNet)
