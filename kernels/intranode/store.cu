// Image `intranode.fatbin`: the intranode kernels with every peer reached through a mapping of
// its buffer (CUDA IPC or `nvshmem_ptr`).
#include "common/net.cuh"
#include "intranode/kernels.cuh"
#include "ll/kernels.cuh"

EPCOMM_INTRANODE_KERNELS(epcomm::StoreNet)
EPCOMM_LL_KERNELS(epcomm::StoreNet)
