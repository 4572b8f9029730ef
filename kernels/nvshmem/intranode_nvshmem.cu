// The NVSHMEM variant of the intranode kernels (`intranode_nvshmem.cubin`, device-linked with
// libnvshmem_device and registered with nvshmemx_cumodule_init after NVSHMEM is initialised).
// Peers whose bit is set in OpArgs::remote_mask are reached with NVSHMEM put/signal, every
// other peer through its `nvshmem_ptr` mapping. Kernel bodies: epcomm/intranode.cuh.
#define EPCOMM_NET_NVSHMEM 1
#include "epcomm/intranode.cuh"
