//! epcomm-transport
