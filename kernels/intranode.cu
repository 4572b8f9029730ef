// The store variant of the intranode kernels (`intranode.fatbin`): every peer is reached through
// a mapping of its buffer (CUDA IPC or `nvshmem_ptr`). Kernel bodies: epcomm/intranode.cuh.
#include "epcomm/intranode.cuh"
