//! epcomm-kernels
