//! Rank masking for the low-latency ops ([`crate::BufferConfig::ll_masking`], DeepEP's shrink
//! mode): the mask words, one `u32` per group rank (1 = masked) in this rank's stats region
//! (`abi::STATS_MASK_OFFSET`), which the low-latency kernels read at the start of every op and
//! set when a wait for a peer expires, and which these methods read and write in stream order.
//!
//! A masked rank is sent no rows and waited for by nothing: a low-latency dispatch receives no
//! rows from it (its count and layout range are 0), and a combine adds nothing for the entries
//! whose expert it holds (as if their id were -1). It still receives each op's completion
//! counter (one word per block), so that a rank masked while it kept running stays in step and
//! can be unmasked. The mask is this rank's own: each rank masks the peers it found late, and a
//! dead peer is found by every rank that waits for it.

use cudarc::driver::DevicePtrMut;
use epcomm_kernels::abi;
use epcomm_topology::{Parity, RegionKind};

use crate::buffer::Buffer;
use crate::buffer::driver::{copy_async, fill_u32_async};
use crate::buffer::pointers::check_device_ptr;
use crate::error::DriverContext;
use crate::{Error, Result};

impl Buffer {
    /// The device address of this rank's mask words (`[world]` u32), or the error that names
    /// `ll_masking` when the config leaves masking off.
    fn ll_mask_words(&self) -> Result<u64> {
        if !self.cfg.ll_masking {
            return Err(Error::InvalidArgument {
                argument: "ll_masking",
                rule: "is off in this Buffer's config: set BufferConfig::ll_masking on every \
                       rank to mask ranks"
                    .into(),
            });
        }
        let stats = self
            .place
            .plan
            .region(RegionKind::Stats, Parity::Even)
            .offset;
        Ok(self.memory.mem.local_base() + stats + abi::STATS_MASK_OFFSET)
    }

    /// Masks (`masked`) or unmasks group rank `rank` for the low-latency ops queued after this
    /// call on the buffer's stream. Unmask only a rank that ran every low-latency op in step
    /// with this one (one masked by the caller, not one that stopped): a rank whose ops fell
    /// behind is waited for again, and masked again at the timeout.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `ll_masking` when masking is off, or `rank` when it is
    /// not a peer (out of range, or this rank).
    pub fn ll_set_masked(&mut self, rank: usize, masked: bool) -> Result<()> {
        let words = self.ll_mask_words()?;
        if rank >= self.place.world || rank == self.place.rank {
            return Err(Error::InvalidArgument {
                argument: "rank",
                rule: format!(
                    "must be a peer: in 0..{} and not this rank ({}) (got {rank})",
                    self.place.world, self.place.rank
                ),
            });
        }
        self.check()?;
        self.launcher
            .ctx
            .bind_to_thread()
            .context("binding the CUDA context")?;
        // SAFETY: the word lies in this rank's stats region (`ll_mask_words`, rank < world <=
        // kMaxWorld), which the buffer owns; the write is ordered on its stream.
        unsafe {
            fill_u32_async(
                words + 4 * rank as u64,
                u32::from(masked),
                1,
                &self.launcher.stream,
            )
        }
        .context("writing a rank's mask word")?;
        self.mark_launch();
        Ok(())
    }

    /// Unmasks every rank (DeepEP's `low_latency_clean_mask_buffer`), in stream order; the
    /// caveat of [`Self::ll_set_masked`] holds for each.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `ll_masking` when masking is off.
    pub fn ll_clear_mask(&mut self) -> Result<()> {
        let words = self.ll_mask_words()?;
        self.check()?;
        self.launcher
            .ctx
            .bind_to_thread()
            .context("binding the CUDA context")?;
        // SAFETY: `world` words of this rank's stats region (world <= kMaxWorld), ordered on
        // the buffer's stream.
        unsafe { fill_u32_async(words, 0, self.place.world, &self.launcher.stream) }
            .context("clearing the mask words")?;
        self.mark_launch();
        Ok(())
    }

    /// Copies the mask (`[world]` i32, 1 = masked, 0 = not) into `status` in stream order, as
    /// the ops queued so far leave it: no host wait (DeepEP's
    /// `low_latency_query_mask_buffer`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `ll_masking` when masking is off, or `status` when it
    /// does not hold `world` values on this buffer's device.
    pub fn ll_mask_into(&mut self, status: &mut dyn DevicePtrMut<i32>) -> Result<()> {
        let words = self.ll_mask_words()?;
        if status.len() != self.place.world {
            return Err(Error::InvalidArgument {
                argument: "status",
                rule: format!(
                    "must hold world = {} values (got {})",
                    self.place.world,
                    status.len()
                ),
            });
        }
        self.check()?;
        let s = self.launcher.stream.clone();
        let (dst, _guard) = status.device_ptr_mut(&s);
        check_device_ptr(
            "status",
            dst,
            self.place.world * 4,
            4,
            self.launcher.ctx.ordinal(),
        )?;
        // SAFETY: `dst` holds world i32 values on this device (checked above) and stays
        // borrowed until the guard records its event after the copy; the source is `world`
        // words of this rank's stats region.
        unsafe { copy_async(dst, words, self.place.world * 4, &s) }
            .context("copying the mask words")?;
        self.mark_launch();
        Ok(())
    }

    /// The masked ranks, once the ops queued so far have finished (waits for the stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `ll_masking` when masking is off; a driver error.
    pub fn ll_masked_ranks(&mut self) -> Result<Vec<usize>> {
        let words = self.ll_mask_words()?;
        self.check()?;
        // SAFETY: `world` u32 words of this rank's stats region, which the buffer owns.
        let mask: Vec<u32> = unsafe {
            epcomm_transport::memory::copy_dtoh(&self.launcher.stream, words, self.place.world)
        }?;
        Ok((0..self.place.world).filter(|&r| mask[r] != 0).collect())
    }
}
