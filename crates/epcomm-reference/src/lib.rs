//! epcomm-reference
