//! epcomm-bootstrap
