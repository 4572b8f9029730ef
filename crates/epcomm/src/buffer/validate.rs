//! Input validation: everything an op checks on the host before it launches, so that a bad
//! argument fails with [`Error::InvalidArgument`] naming it, and never faults or corrupts on
//! the device. Shapes come from the config and from the layout or handle an op is given; row
//! sizes and the FP8 rule from [`RowFormat`]; caller addresses go through `pointers`.
//!
//! Nothing here touches device memory or the sequence mirror: a failed check leaves the buffer
//! exactly as it was. (The transport may register caller arrays its puts read, through
//! `SymmetricMemory::prepare_put_source`; that changes no data either.)

use std::fmt::Display;

use epcomm_kernels::abi::OpArgs;
use epcomm_topology::{RowDtype, RowFormat};

use super::inputs::{DispatchInput, XInput};
use super::pointers::{ROW_ALIGN, check_device_ptr};
use super::{Buffer, LatestDispatch};
use crate::handle::{Handle, HandleInner};
use crate::layout::LayoutInner;
use crate::{Error, RecvMode, Result};

/// Fails with [`Error::InvalidArgument`] naming `argument` unless it holds exactly `expected`
/// elements; the rule reads "`{must} = {expected} {unit} (holds {len})`".
pub(super) fn exact_len(
    argument: &'static str,
    len: usize,
    must: impl Display,
    expected: usize,
    unit: &str,
) -> Result<()> {
    if len == expected {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        argument,
        rule: format!("{must} = {expected} {unit} (holds {len})"),
    })
}

impl Buffer {
    /// Fails unless the object (`argument`) carrying `buffer_id` was made by this buffer.
    pub(super) fn check_owner(
        &self,
        buffer_id: u64,
        argument: &'static str,
        rule: &str,
    ) -> Result<()> {
        if buffer_id != self.id {
            return Err(Error::InvalidArgument {
                argument,
                rule: rule.into(),
            });
        }
        Ok(())
    }

    /// `layout` (or a handle's layout), if this buffer made it.
    pub(super) fn own_layout<'l>(&self, layout: &'l LayoutInner) -> Result<&'l LayoutInner> {
        self.check_owner(
            layout.buffer_id,
            "layout/handle",
            "was produced by another Buffer",
        )?;
        Ok(layout)
    }

    /// `handle`'s state, if this buffer made it.
    pub(super) fn own_handle<'h>(&self, handle: &'h Handle) -> Result<&'h HandleInner> {
        if handle.is_two_tier() {
            return Err(Error::InvalidArgument {
                argument: "handle",
                rule: "is a two-tier handle: pass it to the HierarchicalBuffer that produced it"
                    .into(),
            });
        }
        self.check_owner(
            handle.inner.buffer_id,
            "handle",
            "was produced by another Buffer",
        )?;
        Ok(&handle.inner)
    }

    /// The checks before an op along `handle`'s routing (cached dispatch, combine): the buffer
    /// is healthy, made `handle`, and a dispatch wrote it with its layout's current routing.
    pub(super) fn routed_handle<'h>(&mut self, handle: &'h Handle) -> Result<&'h HandleInner> {
        self.check_ready()?;
        let h = self.own_handle(handle)?;
        h.check_routing()?;
        Ok(h)
    }

    /// Fails unless `num_tokens` fits the buffer (`max_tokens_per_rank`).
    pub(super) fn check_tokens(&self, num_tokens: usize) -> Result<()> {
        if num_tokens > self.cfg.max_tokens_per_rank {
            return Err(Error::InvalidArgument {
                argument: "num_tokens",
                rule: format!(
                    "at most max_tokens_per_rank = {} (got {num_tokens})",
                    self.cfg.max_tokens_per_rank
                ),
            });
        }
        Ok(())
    }

    /// The format of this buffer's rows of `dtype`. BF16 always fits (the config checked
    /// `hidden`); FP8 needs `hidden % 128 == 0`, reported against `x`.
    fn row_format(&self, dtype: RowDtype) -> Result<RowFormat> {
        let h = self.cfg.hidden;
        RowFormat::new(h, dtype).map_err(|e| match dtype {
            RowDtype::Fp8 => Error::InvalidArgument {
                argument: "x",
                rule: format!(
                    "FP8 dispatch needs hidden % {} == 0 (hidden = {h})",
                    RowFormat::FP8_BLOCK
                ),
            },
            RowDtype::Bf16 => e.into(),
        })
    }

    /// Checks `x` (and FP8 scales) for `num_tokens` rows; returns their format.
    pub(super) fn check_x(&self, x: &XInput<'_>, num_tokens: usize) -> Result<RowFormat> {
        let row = self.row_format(x.dtype())?;
        let unit = match row.dtype() {
            RowDtype::Bf16 => "values",
            RowDtype::Fp8 => "bytes",
        };
        exact_len(
            "x",
            x.len(),
            format_args!("{} x must hold num_tokens * hidden", row.dtype().name()),
            num_tokens * row.hidden(),
            unit,
        )?;
        if let XInput::Fp8 { scales, .. } = x {
            exact_len(
                "scales",
                scales.len(),
                format_args!("must hold num_tokens * hidden / {}", RowFormat::FP8_BLOCK),
                num_tokens * row.num_scales(),
                "values",
            )?;
        }
        Ok(row)
    }

    /// Checks a dispatch's inputs for `t` tokens (the layout's); returns the rows' format.
    pub(super) fn check_dispatch_input(
        &self,
        input: &DispatchInput<'_>,
        t: usize,
    ) -> Result<RowFormat> {
        let row = self.check_x(&input.x, t)?;
        let k = self.cfg.top_k;
        if input.topk_idx.len() != t * k {
            return Err(Error::InvalidArgument {
                argument: "topk_idx",
                rule: format!(
                    "must hold {} ids like the layout's (holds {})",
                    t * k,
                    input.topk_idx.len()
                ),
            });
        }
        if let Some(w) = input.topk_weights {
            exact_len(
                "topk_weights",
                w.len(),
                "must hold num_tokens * top_k",
                t * k,
                "values",
            )?;
        }
        Ok(row)
    }

    /// The most rows a dispatch in `mode` may receive (the kernel enforces it on every rank).
    pub(super) fn recv_capacity(&self, mode: RecvMode) -> Result<usize> {
        let cap = self.place.plan.recv_rows() as usize;
        match mode {
            RecvMode::Bounded(n) if n > cap => Err(Error::InvalidArgument {
                argument: "RecvMode::Bounded",
                rule: format!("at most the buffer's capacity of {cap} rows (got {n})"),
            }),
            RecvMode::Bounded(n) => Ok(n),
            _ => Ok(cap),
        }
    }

    /// Combine: `y` (`y_len` values) must hold every row `h` may have received, and weights
    /// come in pairs (`y_weights_len` with `out_weights`), each holding `top_k` per row.
    pub(super) fn check_combine_y(
        &self,
        h: &HandleInner,
        y_len: usize,
        y_weights_len: Option<usize>,
        out_weights: bool,
    ) -> Result<()> {
        let (hd, k) = (self.cfg.hidden, self.cfg.top_k);
        let rows = h.rows_bound();
        if y_len < rows * hd || !y_len.is_multiple_of(hd) {
            let what = if h.num_recv.is_some() {
                "received"
            } else {
                "capacity: WorstCase dispatch"
            };
            return Err(Error::InvalidArgument {
                argument: "y",
                rule: format!(
                    "must hold rows * hidden = {} values (holds {y_len}); rows = {rows} ({what})",
                    rows * hd,
                ),
            });
        }
        match (y_weights_len, out_weights) {
            (Some(w), true) if w < rows * k => Err(Error::InvalidArgument {
                argument: "y_weights",
                rule: format!("must hold rows * top_k = {} values (holds {w})", rows * k,),
            }),
            (Some(_), true) | (None, false) => Ok(()),
            _ => Err(Error::InvalidArgument {
                argument: "y_weights/out_weights",
                rule: "give both or neither".into(),
            }),
        }
    }

    /// In-place combine: `h` must be the handle of this rank's latest dispatch, a BF16 one,
    /// and `out_weights` needs weights that dispatch carried.
    pub(super) fn check_in_place(&self, h: &HandleInner, out_weights: bool) -> Result<()> {
        match &self.latest_dispatch {
            Some(latest)
                if latest.dtype == RowDtype::Bf16 && std::ptr::eq(latest.handle.as_ptr(), h) =>
            {
                if out_weights && !latest.weights {
                    return Err(Error::InvalidArgument {
                        argument: "out_weights",
                        rule: "in-place combine sums the top-k weights the latest dispatch \
                               received, and that dispatch carried none (a cached dispatch, or \
                               one without topk_weights): pass None"
                            .into(),
                    });
                }
                Ok(())
            }
            Some(LatestDispatch {
                dtype: RowDtype::Fp8,
                ..
            }) => Err(Error::InvalidArgument {
                argument: "handle",
                rule: "in-place combine needs a BF16 latest dispatch (FP8 rows cannot hold bf16 y)"
                    .into(),
            }),
            _ => Err(Error::InvalidArgument {
                argument: "handle",
                rule: "in-place combine needs the handle of this rank's latest dispatch".into(),
            }),
        }
    }

    /// Combine outputs for `t` tokens: `out` holds `t * hidden` values, `out_weights` (if
    /// given) `t * top_k`.
    pub(super) fn check_combine_out(
        &self,
        t: usize,
        out_len: usize,
        out_weights_len: Option<usize>,
    ) -> Result<()> {
        let (hd, k) = (self.cfg.hidden, self.cfg.top_k);
        exact_len(
            "out",
            out_len,
            "must hold num_tokens * hidden",
            t * hd,
            "values",
        )?;
        if let Some(o) = out_weights_len {
            exact_len(
                "out_weights",
                o,
                "must hold num_tokens * top_k",
                t * k,
                "values",
            )?;
        }
        Ok(())
    }

    /// The caller addresses of a dispatch of `t` tokens as the kernel will read them (`a`
    /// filled in): alignment and device (see `pointers`). Absent arrays are 0 and pass.
    pub(super) fn check_dispatch_ptrs(&self, a: &OpArgs, t: usize) -> Result<()> {
        let (dev, k) = (self.launcher.ctx.ordinal(), self.cfg.top_k);
        check_device_ptr("x", a.x, t * a.row_bytes as usize, ROW_ALIGN, dev)?;
        check_device_ptr("scales", a.x_scales, t * a.num_scales as usize * 4, 4, dev)?;
        check_device_ptr("topk_idx", a.topk_idx, t * k * 8, 8, dev)?;
        check_device_ptr("topk_weights", a.topk_weights, t * k * 4, 4, dev)?;
        // Rows are put from `x` itself. Scales, ids and weights travel element by element as
        // values (NVSHMEM), or as rows read from the caller's arrays (the CPU proxy).
        self.prepare_put_source("x", a.x, t * a.row_bytes as usize)?;
        if self
            .memory
            .transport
            .capabilities()
            .kernel_family
            .puts_metadata_rows()
        {
            self.prepare_put_source("scales", a.x_scales, t * a.num_scales as usize * 4)?;
            self.prepare_put_source("topk_idx", a.topk_idx, t * k * 8)?;
            self.prepare_put_source("topk_weights", a.topk_weights, t * k * 4)?;
        }
        Ok(())
    }

    /// The caller addresses of a combine of `t` tokens and up to `rows` received rows, as the
    /// kernel will read and write them (`a` filled in; `y` is 0 in place and passes).
    pub(super) fn check_combine_ptrs(&self, a: &OpArgs, rows: usize, t: usize) -> Result<()> {
        let (dev, hd, k) = (self.launcher.ctx.ordinal(), self.cfg.hidden, self.cfg.top_k);
        check_device_ptr("y", a.x, rows * hd * 2, ROW_ALIGN, dev)?;
        check_device_ptr("y_weights", a.topk_weights, rows * k * 4, 4, dev)?;
        check_device_ptr("out", a.out, t * hd * 2, ROW_ALIGN, dev)?;
        check_device_ptr("out_weights", a.out_weights, t * k * 4, 4, dev)?;
        // Rows and their weights are put from the caller's arrays (0 in place: the buffer).
        self.prepare_put_source("y", a.x, rows * hd * 2)?;
        self.prepare_put_source("y_weights", a.topk_weights, rows * k * 4)
    }

    /// Makes a caller array that the kernel puts from readable by the transport's put
    /// operations ([`epcomm_transport::SymmetricMemory::prepare_put_source`]), when some peer
    /// is reached by put/signal. Absent (0) and empty arrays are never read and pass.
    pub(super) fn prepare_put_source(
        &self,
        argument: &'static str,
        ptr: u64,
        bytes: usize,
    ) -> Result<()> {
        if self.place.remote_mask == 0 || ptr == 0 || bytes == 0 {
            return Ok(());
        }
        Ok(self.memory.mem.prepare_put_source(argument, ptr, bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_rules_name_the_argument_the_expected_and_the_held_count() {
        let e = exact_len(
            "x",
            3,
            format_args!("{} x must hold num_tokens * hidden", RowDtype::Bf16.name()),
            4,
            "values",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid x: bf16 x must hold num_tokens * hidden = 4 values (holds 3)"
        );
        let e = exact_len("topk_idx", 0, "must hold num_tokens * top_k", 16, "ids").unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid topk_idx: must hold num_tokens * top_k = 16 ids (holds 0)"
        );
        exact_len("out", 8, "must hold num_tokens * hidden", 8, "values").unwrap();
    }
}
