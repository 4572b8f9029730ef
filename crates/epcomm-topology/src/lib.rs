//! epcomm-topology
