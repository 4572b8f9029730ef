//! epcomm-transport-ipc
