//! epcomm
