//! Combine staging ([`CombineStaging`]): whether a combine's `y` is pushed by the kernel's SMs or
//! copied by the copy engine over the latest dispatch's receive rows and pulled by the owners.
//!
//! Memory contract of the copy: it is issued on the buffer's stream right before the combine
//! kernel, so it starts after every earlier op of this rank (the dispatch that filled the rows,
//! the caller's expert kernels) and the kernel starts after it ends. The kernel tells every peer
//! that this rank's rows are complete before any peer reads them (the in-place handshake), and a
//! later dispatch reuses the region only after every peer finished reading it (the schedule's
//! reuse rule, as for [`Buffer::combine_in_place`]).
//!
//! Every rank must take the same way, or the kernels wait for a handshake that never comes: the
//! decision uses only what every rank shares (config, routes, the handle's place in the op
//! order, graph capture, which every rank does alike), never an address.

use epcomm_topology::{Parity, RegionKind};

use crate::buffer::Buffer;
use crate::buffer::driver::copy_async;
use crate::buffer::pointers::{ROW_ALIGN, check_device_ptr};
use crate::error::DriverContext;
use crate::handle::HandleInner;
use crate::{CombineStaging, Error, Result};

/// How the latest dispatch was issued, for combine staging: its copy targets the
/// receive rows at the host's parity, right only when the dispatch and the combine are issued
/// alike — both run, or both recorded in the same recording (a recording holding a dispatch is
/// made once per parity, `graph`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::buffer) enum Issued {
    /// Launched on the stream.
    Run,
    /// Recorded in the recording being made now.
    InThisRecording,
    /// Recorded in an earlier recording (it never ran as such).
    InEarlierRecording,
}

/// A device range `[ptr, ptr + bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::buffer) struct DeviceRange {
    pub(in crate::buffer) ptr: u64,
    pub(in crate::buffer) bytes: u64,
}

impl DeviceRange {
    pub(in crate::buffer) fn overlaps(self, other: DeviceRange) -> bool {
        self.ptr < other.ptr.saturating_add(other.bytes)
            && other.ptr < self.ptr.saturating_add(self.bytes)
    }
}

/// Refuses a source that overlaps a receive range the staging writes.
fn refuse_overlap(argument: &'static str, src: DeviceRange, dst: DeviceRange) -> Result<()> {
    if src.bytes > 0 && src.overlaps(dst) {
        return Err(Error::InvalidArgument {
            argument,
            rule: format!(
                "overlaps receive rows the staging writes ({:#x}..{:#x} against {:#x}..{:#x}): \
                 pass it elsewhere, exactly at its own receive rows, or set combine_staging to \
                 push",
                src.ptr,
                src.ptr + src.bytes,
                dst.ptr,
                dst.ptr + dst.bytes
            ),
        });
    }
    Ok(())
}

/// Whether one copy of a staged combine is needed: not when the source already is the
/// destination (the caller wrote it in place); refused when the two overlap otherwise.
fn plan_copy(argument: &'static str, src: DeviceRange, dst: DeviceRange) -> Result<bool> {
    if src.bytes == 0 || src.ptr == dst.ptr {
        return Ok(false);
    }
    refuse_overlap(argument, src, dst)?;
    Ok(true)
}

impl Buffer {
    /// Whether the buffer's stream is recording a graph.
    pub(in crate::buffer) fn capturing(&self) -> Result<bool> {
        let status = self
            .launcher
            .stream
            .capture_status()
            .context("reading the stream's capture status")?;
        Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Marks the start of a recording by [`Buffer::capture`] (or a hierarchical buffer's): a
    /// dispatch recorded before it is not in it.
    pub(crate) fn begin_recording(&mut self) {
        self.capture.recording = true;
        if let Some(l) = &mut self.latest_dispatch
            && l.issued == Issued::InThisRecording
        {
            l.issued = Issued::InEarlierRecording;
        }
    }

    /// Marks the end of a recording that [`Self::begin_recording`] started.
    pub(crate) fn end_recording(&mut self) {
        self.capture.recording = false;
    }

    /// How an op issued now is issued. A dispatch captured by someone else than
    /// [`Buffer::capture`] (a framework's graph) is replayed without the host's op counts
    /// following, so from then on the host does not know the dispatch parity and the buffer
    /// never stages again (every rank captures alike, so every rank stops alike).
    pub(in crate::buffer) fn issued_now(&mut self) -> Result<Issued> {
        Ok(match (self.capturing()?, self.capture.recording) {
            (false, _) => Issued::Run,
            (true, true) => Issued::InThisRecording,
            (true, false) => {
                self.capture.foreign_capture = true;
                Issued::InEarlierRecording
            }
        })
    }

    /// Why the copy-engine staging cannot serve a combine with `h`, if it cannot.
    fn staging_obstacle(&mut self, h: &HandleInner) -> Result<Option<&'static str>> {
        let now = self.issued_now()?;
        if self.capture.foreign_capture {
            return Ok(Some(
                "needs the host to know the dispatch parity, and a dispatch of this buffer was \
                 captured into a graph outside Buffer::capture, whose replays the host does not \
                 count",
            ));
        }
        let Some(latest) = self
            .latest_dispatch
            .as_ref()
            .filter(|l| std::ptr::eq(l.handle.as_ptr(), h))
        else {
            return Ok(Some(
                "stages y over the receive rows of this rank's latest dispatch, and the handle \
                 is not that dispatch's",
            ));
        };
        let alike = matches!(
            (now, latest.issued),
            (Issued::Run, Issued::Run) | (Issued::InThisRecording, Issued::InThisRecording)
        );
        if !alike {
            return Ok(Some(
                "needs the latest dispatch issued like the combine (both run, or both in one \
                 graph recording): the copy's destination is the receive region of the parity \
                 that dispatch wrote",
            ));
        }
        Ok(None)
    }

    /// Decides how this combine moves `y` ([`crate::BufferConfig::combine_staging`]) and, when
    /// staged, issues the copies of `y` (and `y_weights`) over the latest dispatch's receive
    /// rows. Returns `None` to push, or what the in-place kernel reads this rank's own rows
    /// from.
    ///
    /// Only rows a peer reads are copied: up to the host's bound on the received rows (the
    /// exact count after a HostSync dispatch, else the capacity), and, where every peer is
    /// mapped and the host knows them (HostSync), not the rows this rank sent itself, which
    /// the kernel then reads from `y` directly.
    pub(in crate::buffer) fn stage_combine_y(
        &mut self,
        h: &HandleInner,
        y: DeviceRange,
        y_weights: Option<DeviceRange>,
        rows: RecvRows,
    ) -> Result<Option<StagedInputs>> {
        match self.cfg.combine_staging {
            CombineStaging::Push => return Ok(None),
            // Auto stages only where the caller gave the receive rows up (a plain combine
            // leaves the dispatch outputs as they are), where every peer is mapped (a peer
            // behind the transport would still be pushed to, from the receive rows, after the
            // copy), after a HostSync dispatch (only the rows peers read are copied; otherwise
            // every row up to the capacity would be), and at SM counts where the copy costs
            // less than the push.
            CombineStaging::Auto
                if rows == RecvRows::Keep
                    || self.place.remote_mask != 0
                    || h.own_rows.is_none()
                    || self.cfg.num_sms > CombineStaging::AUTO_MAX_SMS =>
            {
                return Ok(None);
            }
            staging => match self.staging_obstacle(h)? {
                Some(rule) if staging == CombineStaging::CopyEngine => {
                    return Err(Error::InvalidArgument {
                        argument: "combine_staging",
                        rule: format!("copy-engine {rule}"),
                    });
                }
                Some(_) => return Ok(None),
                None => {}
            },
        }
        let parity = Parity::of_epoch(self.seq.dispatch);
        let base = self.memory.mem.local_base();
        let region = |k| base + self.place.plan.region(k, parity).offset;
        let rows = h.rows_bound();
        let x_row = self.cfg.hidden as u64 * 2;
        let w_row = self.cfg.top_k as u64 * 4;
        let x = DeviceRange {
            ptr: region(RegionKind::DispatchX),
            bytes: rows as u64 * x_row,
        };
        let w = DeviceRange {
            ptr: region(RegionKind::DispatchTopkWeights),
            bytes: rows as u64 * w_row,
        };
        let y = DeviceRange {
            bytes: x.bytes,
            ..y
        };
        let y_weights = y_weights.map(|r| DeviceRange {
            bytes: w.bytes,
            ..r
        });
        let dev = self.launcher.ctx.ordinal();
        check_device_ptr("y", y.ptr, y.bytes as usize, ROW_ALIGN, dev)?;
        if let Some(yw) = y_weights {
            check_device_ptr("y_weights", yw.ptr, yw.bytes as usize, 4, dev)?;
        }
        let copy_x = plan_copy("y", y, x)?;
        let copy_w = match y_weights {
            Some(yw) => plan_copy("y_weights", yw, w)?,
            None => false,
        };
        // Neither source may lie under the other copy's destination either.
        if copy_w {
            refuse_overlap("y", y, w)?;
        }
        if let Some(yw) = y_weights.filter(|_| copy_x) {
            refuse_overlap("y_weights", yw, x)?;
        }
        // The rows a peer reads: all, or all but this rank's own when the kernel can read those
        // from y (no peer behind the transport pushes from the region then).
        let own = h.own_rows.clone().filter(|_| self.place.remote_mask == 0);
        let ranges = match &own {
            Some(o) => [0..o.start.min(rows), o.end.min(rows)..rows],
            None => [0..rows, rows..rows],
        };
        // (destination, source, row bytes, what) of every copy to issue per range.
        let mut copies = Vec::with_capacity(2);
        if copy_x {
            copies.push((x.ptr, y.ptr, x_row, "staging y over the receive rows"));
        }
        if let (true, Some(yw)) = (copy_w, y_weights) {
            copies.push((
                w.ptr,
                yw.ptr,
                w_row,
                "staging y_weights over the received weights",
            ));
        }
        let s = &self.launcher.stream;
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let (first, n) = (r.start as u64, (r.end - r.start) as u64);
            for &(dst, src, row, what) in &copies {
                // SAFETY: the destination rows lie in this rank's receive region of the latest
                // dispatch's parity (rows of `hidden` bf16 values, sized for BF16 whatever the
                // dispatch's type, or of `top_k` f32 weights), which holds `max_rows >= rows`
                // rows; the source holds at least `rows` rows (check_combine_y) and does not
                // overlap it (plan_copy). Stream-ordered after every earlier op of this rank,
                // before the combine kernel.
                unsafe { copy_async(dst + first * row, src + first * row, (n * row) as usize, s) }
                    .context(what)?;
            }
        }
        Ok(Some(match own {
            Some(_) => StagedInputs {
                y: y.ptr,
                y_weights: y_weights.map_or(0, |r| r.ptr),
            },
            None => StagedInputs::default(),
        }))
    }
}

/// What a combine may do with the receive rows of the handle's dispatch (`recv_x`, its scales
/// and `recv_topk_weights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::buffer) enum RecvRows {
    /// The caller may still read them ([`Buffer::combine`]): only an explicit
    /// [`CombineStaging::CopyEngine`] config stages over them.
    Keep,
    /// The caller is done with them ([`crate::CombineInput::consuming`]): [`CombineStaging::Auto`]
    /// may stage over them where that is faster.
    Consume,
}

/// Where a staged combine's kernel reads this rank's own rows: `y` and its weights (the caller's,
/// not copied), or 0: the receive region, like every peer's rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(in crate::buffer) struct StagedInputs {
    pub(in crate::buffer) y: u64,
    pub(in crate::buffer) y_weights: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(ptr: u64, bytes: u64) -> DeviceRange {
        DeviceRange { ptr, bytes }
    }

    #[test]
    fn a_copy_is_skipped_in_place_done_when_apart_and_refused_when_overlapping() {
        assert!(!plan_copy("y", r(0x1000, 64), r(0x1000, 64)).unwrap());
        assert!(!plan_copy("y", r(0x5000, 0), r(0x1000, 64)).unwrap());
        assert!(plan_copy("y", r(0x2000, 64), r(0x1000, 64)).unwrap());
        assert!(plan_copy("y", r(0x1000 - 64, 64), r(0x1000, 64)).unwrap());
        let err = plan_copy("y_weights", r(0x1020, 64), r(0x1000, 64))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("y_weights") && err.contains("overlaps") && err.contains("push"),
            "{err}"
        );
        assert!(plan_copy("y", r(0x0fc0, 65), r(0x1000, 64)).is_err());
        // A source under the other copy's destination is refused even at its very start.
        assert!(refuse_overlap("y", r(0x1000, 64), r(0x1000, 8)).is_err());
        assert!(refuse_overlap("y", r(0x2000, 64), r(0x1000, 64)).is_ok());
        assert!(refuse_overlap("y", r(0x1000, 0), r(0x1000, 64)).is_ok());
    }
}
