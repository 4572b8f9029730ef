// Image `intranode.fatbin`: the intranode kernels with every peer reached through a mapping of
// its buffer (CUDA IPC or `nvshmem_ptr`).
#include "common/net.cuh"
#include "intranode/kernels.cuh"

EPCOMM_INTRANODE_KERNELS(epcomm::StoreNet)
