//! [`BindError`] → a Python exception of `epcomm.errors` (class, message and attributes from
//! [`BindError::info`]), and the small conversions the module's functions share.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{Attr, BindError};

/// The Python module that defines the exception classes.
const ERRORS_MODULE: &str = "epcomm.errors";

/// The exception `e` becomes. Should the classes be unavailable (the package is broken), a
/// `RuntimeError` with the same message.
pub(crate) fn to_pyerr(py: Python<'_>, e: BindError) -> PyErr {
    let info = e.info();
    let raised = || -> PyResult<PyErr> {
        let class = py.import(ERRORS_MODULE)?.getattr(info.class)?;
        let kwargs = PyDict::new(py);
        for (key, value) in &info.attrs {
            match value {
                Attr::None => kwargs.set_item(key, py.None())?,
                Attr::Int(v) => kwargs.set_item(key, v)?,
                Attr::Float(v) => kwargs.set_item(key, v)?,
                Attr::Str(v) => kwargs.set_item(key, v)?,
                Attr::Ints(v) => kwargs.set_item(key, v)?,
            }
        }
        Ok(PyErr::from_value(
            class.call((info.message.as_str(),), Some(&kwargs))?,
        ))
    };
    raised().unwrap_or_else(|_| PyRuntimeError::new_err(info.message.clone()))
}

/// Runs `f` without the GIL (it may block on peers or the device) and raises its error.
pub(crate) fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, BindError> + Send,
) -> PyResult<T> {
    py.detach(f).map_err(|e| to_pyerr(py, e))
}
