//! The descriptor: one fixed-size, `#[repr(C)]` record per piece of work a kernel hands to the
//! proxy, and its validated encoding and decoding.
//!
//! # Layout (32 bytes, 8-byte aligned, little-endian; shared with the CUDA side)
//!
//! | bytes  | field   | bits | transfer ([`KIND_TRANSFER`] = 1) | signal ([`KIND_SIGNAL`] = 2) | write ([`KIND_WRITE`] = 3) |
//! |--------|---------|------|----------------------------------|------------------------------|----------------------------|
//! | 0..2   | `kind`  | 16   | 1 | 2 | 3 (0 and every other value are invalid) |
//! | 2..4   | `flags` | 16   | bit 0 = [`TRANSFER_FLAG_SRC_ADDRESS`]; bits 1..15 must be 0 | bit 0 = [`SIGNAL_FLAG_ADD`] (0 = set, 1 = add); bits 1..15 must be 0 | bit 0 = [`WRITE_FLAG_SEQUENCE`]; bits 1..15 must be 0 |
//! | 4..8   | `peer`  | 32   | destination rank, `< world` | destination rank, `< world` | destination rank, `< world` |
//! | 8..16  | `arg0`  | 64   | source: an offset in this rank's symmetric buffer, or (flag set) a device address, non-zero | offset of the peer's 64-bit signal word (multiple of 8) | destination offset in the peer's buffer (multiple of the width) |
//! | 16..24 | `arg1`  | 64   | destination offset in the peer's symmetric buffer | the value (stored, or added) | the (first) value, zero-extended (width 4: bits 32..63 must be 0) |
//! | 24..32 | `arg2`  | 64   | bytes to move (> 0) | words the value is stored into: 0 or 1 = one word, `n` = `n` consecutive words (a set only; an add has one word) | bits 0..31: width in bytes, 4 or 8; bits 32..63: with the sequence flag the element count `n` >= 1, else 0 |
//!
//! Offsets are byte offsets into the symmetric buffer (the same [`Limits::heap_bytes`] on every
//! rank); a range `[offset, offset + bytes)` must fit in it. As 64-bit words (what the ring
//! stores, [`RawDescriptor::to_words`]): word 0 = `kind | flags << 16 | peer << 32`, words 1..3 =
//! `arg0..arg2`.
//!
//! A **write with the sequence flag** stores `n` consecutive elements `value, value + 1, ...,
//! value + n - 1` (the last must fit in the width): a run of consecutive token indices in one
//! descriptor. A **signal over `n` words** stores the value into each of them, after everything
//! before it in the ring: the per-row flags of a run in one descriptor.
//!
//! A transfer's source is [`Source::Heap`] (flag clear: an offset, bounds-checked like every
//! other offset) or [`Source::Address`] (flag set: a device virtual address valid in the
//! producing process, so a kernel can put straight from caller memory). The decoder cannot
//! bounds-check an address — it does not know the producer's allocations — and checks only that
//! it is non-zero and that `[address, address + bytes)` does not wrap around the 64-bit address
//! space; a bad address surfaces as an executor failure (or, on a GPU, a fault).
//!
//! [`Descriptor::encode`] and [`RawDescriptor::decode`] apply the same rules; every violation is
//! a [`DescriptorError`] naming the [`Field`] and the rule.
//!
//! # Ordering contract
//!
//! A **signal** to peer `p` takes effect after every transfer and write to `p` that precedes it
//! in the ring. Transfers and writes to one peer need no order among themselves: the kernels
//! never target overlapping bytes with them within one operation (dispatch, combine), so the
//! coalescer may hold a transfer run open while later writes pass it. Executors still keep
//! per-peer submission order ([`crate::executor`]), which is the simplest way to honour the
//! signal rule. Signals need no order among themselves where they **set** distinct words to
//! one value (each such word is waited for on its own: a count word, a run's flags): the
//! copy-engine executor lays such signals out anew by destination when they are pending
//! together. Adds, and sets of other values, keep their ring order among signals.

use std::fmt;

/// `kind` of a transfer descriptor.
pub const KIND_TRANSFER: u16 = 1;
/// `kind` of a signal descriptor.
pub const KIND_SIGNAL: u16 = 2;
/// `kind` of a write descriptor (an inline store of a 4- or 8-byte value).
pub const KIND_WRITE: u16 = 3;
/// Bit of `flags` that makes a transfer's `arg0` a device address ([`Source::Address`])
/// instead of an offset in this rank's symmetric buffer ([`Source::Heap`]).
pub const TRANSFER_FLAG_SRC_ADDRESS: u16 = 1;
/// Bit of `flags` that selects [`SignalOp::Add`] in a signal descriptor.
pub const SIGNAL_FLAG_ADD: u16 = 1;
/// Bit of `flags` that makes a write a sequence: `arg2`'s bits 32..63 hold the element count
/// ([`Write::count`]).
pub const WRITE_FLAG_SEQUENCE: u16 = 1;
/// Size of a signal word in bytes; signal offsets are multiples of it.
pub const SIGNAL_WORD_BYTES: u64 = 8;
/// Size of [`RawDescriptor`] in bytes.
pub const DESCRIPTOR_BYTES: usize = 32;

/// The descriptor as it sits in memory (see the module docs for every field's bits).
///
/// Any bit pattern is a `RawDescriptor`; only [`RawDescriptor::decode`] says whether it means
/// something.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RawDescriptor {
    /// [`KIND_TRANSFER`], [`KIND_SIGNAL`] or [`KIND_WRITE`].
    pub kind: u16,
    /// Kind-specific flags ([`TRANSFER_FLAG_SRC_ADDRESS`], [`SIGNAL_FLAG_ADD`],
    /// [`WRITE_FLAG_SEQUENCE`]).
    pub flags: u16,
    /// Destination rank.
    pub peer: u32,
    /// Transfer: source offset or address. Signal: signal word offset. Write: destination
    /// offset.
    pub arg0: u64,
    /// Transfer: destination offset. Signal, write: value.
    pub arg1: u64,
    /// Transfer: bytes. Signal: words (0 or 1: one). Write: width (4 or 8), and a sequence's
    /// count in bits 32..63.
    pub arg2: u64,
}

const _: () = assert!(std::mem::size_of::<RawDescriptor>() == DESCRIPTOR_BYTES);
const _: () = assert!(std::mem::align_of::<RawDescriptor>() == 8);

/// A field of a descriptor, named as in the layout table of the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// `kind`.
    Kind,
    /// `flags`.
    Flags,
    /// `peer`.
    Peer,
    /// `arg0` of a transfer from the symmetric buffer ([`Source::Heap`]).
    SrcOffset,
    /// `arg0` of a transfer from a device address ([`Source::Address`]).
    SrcAddress,
    /// `arg1` of a transfer.
    DstOffset,
    /// `arg2` of a transfer.
    Bytes,
    /// `arg0` of a signal.
    SignalOffset,
    /// `arg2` of a signal (its word count).
    SignalWords,
    /// `arg0` of a write.
    WriteOffset,
    /// `arg1` of a write.
    WriteValue,
    /// `arg2` of a write, bits 0..31 (its width).
    WriteWidth,
    /// `arg2` of a write, bits 32..63 (a sequence's element count).
    WriteCount,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Field::Kind => "kind",
            Field::Flags => "flags",
            Field::Peer => "peer",
            Field::SrcOffset => "arg0 (transfer source offset)",
            Field::SrcAddress => "arg0 (transfer source address)",
            Field::DstOffset => "arg1 (transfer destination offset)",
            Field::Bytes => "arg2 (transfer bytes)",
            Field::SignalOffset => "arg0 (signal word offset)",
            Field::SignalWords => "arg2 (signal words)",
            Field::WriteOffset => "arg0 (write destination offset)",
            Field::WriteValue => "arg1 (write value)",
            Field::WriteWidth => "arg2 bits 0..31 (write width)",
            Field::WriteCount => "arg2 bits 32..63 (write sequence count)",
        })
    }
}

/// What the receiving side bounds a descriptor by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Ranks in the world: `peer < world`.
    pub world: u32,
    /// Bytes of the symmetric buffer on every rank: every range must fit in it.
    pub heap_bytes: u64,
}

/// A rule a descriptor broke; each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// `kind` is not [`KIND_TRANSFER`], [`KIND_SIGNAL`] or [`KIND_WRITE`].
    #[error("descriptor field `kind` is {value}: must be 1 (transfer), 2 (signal) or 3 (write)")]
    UnknownKind {
        /// The value found.
        value: u16,
    },
    /// A field or bits reserved for this kind are not zero.
    #[error("descriptor field `{field}` is {value:#x}: bits reserved for this kind must be 0")]
    Reserved {
        /// The field.
        field: Field,
        /// The value found.
        value: u64,
    },
    /// `peer` is not a rank of the world.
    #[error("descriptor field `peer` is {peer}: must be below the world size {world}")]
    PeerOutOfRange {
        /// The value found.
        peer: u32,
        /// Ranks in the world.
        world: u32,
    },
    /// A transfer of zero bytes.
    #[error(
        "descriptor field `{}` is 0: a transfer moves at least one byte",
        Field::Bytes
    )]
    EmptyTransfer,
    /// A transfer's source address ([`Source::Address`]) is 0.
    #[error(
        "descriptor field `{}` is 0: a device source address must be non-zero",
        Field::SrcAddress
    )]
    NullAddress,
    /// A transfer's source address range wraps around the 64-bit address space.
    #[error(
        "descriptor field `{}` is {address:#x}: [{address:#x}, {address:#x} + {bytes}) wraps \
         around the 64-bit address space",
        Field::SrcAddress
    )]
    AddressWraps {
        /// The address found.
        address: u64,
        /// The transfer's length.
        bytes: u64,
    },
    /// A signal over zero words ([`Signal::words`] 0; in the record, 0 means one word): from
    /// [`Descriptor::encode`] only.
    #[error(
        "descriptor field `{}` (Signal::words) is 0: a signal changes at least one word",
        Field::SignalWords
    )]
    EmptySignal,
    /// A write's width is neither 4 nor 8.
    #[error(
        "descriptor field `{}` is {value}: a write stores 4 or 8 bytes",
        Field::WriteWidth
    )]
    InvalidWidth {
        /// The value found.
        value: u64,
    },
    /// A signal that adds names more than one word.
    #[error(
        "descriptor field `{}` is {words}: a signal that adds changes one word (0 or 1)",
        Field::SignalWords
    )]
    AddToWords {
        /// The value found.
        words: u64,
    },
    /// A write with the sequence flag has a count of 0.
    #[error(
        "descriptor field `{}` is 0: a sequence write stores at least one element",
        Field::WriteCount
    )]
    EmptySequence,
    /// A write's last element (`value + count - 1`) does not fit in its width.
    #[error(
        "descriptor field `{}` is {value:#x} with {count} elements: the last, value + {count} - 1, \
         must fit in {width} bytes",
        Field::WriteValue
    )]
    SequenceTooWide {
        /// The first value.
        value: u64,
        /// The element count.
        count: u32,
        /// The write's width in bytes.
        width: u64,
    },
    /// A 4-byte write's value has bits set above bit 31.
    #[error(
        "descriptor field `{}` is {value:#x}: a {width}-byte write's value must fit in {width} \
         bytes (zero-extended)",
        Field::WriteValue
    )]
    ValueTooWide {
        /// The value found.
        value: u64,
        /// The write's width in bytes.
        width: u64,
    },
    /// An offset is not a multiple of its alignment.
    #[error("descriptor field `{field}` is {value}: must be a multiple of {align}")]
    Misaligned {
        /// The field.
        field: Field,
        /// The value found.
        value: u64,
        /// The alignment required.
        align: u64,
    },
    /// A range does not fit in the symmetric buffer.
    #[error(
        "descriptor field `{field}` is {offset}: [{offset}, {offset} + {bytes}) must fit in the \
         {heap_bytes}-byte symmetric buffer"
    )]
    OutOfBounds {
        /// The field holding the range's start.
        field: Field,
        /// The range's start.
        offset: u64,
        /// The range's length.
        bytes: u64,
        /// [`Limits::heap_bytes`].
        heap_bytes: u64,
    },
}

/// Where a transfer reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// An offset in this rank's symmetric buffer (bounds-checked against
    /// [`Limits::heap_bytes`]); `flags` bit [`TRANSFER_FLAG_SRC_ADDRESS`] clear.
    Heap(u64),
    /// A device (virtual) address valid in the producing process, non-zero; `flags` bit
    /// [`TRANSFER_FLAG_SRC_ADDRESS`] set. Not bounds-checked by the decoder (see the
    /// [module docs](self)).
    Address(u64),
}

impl Source {
    /// The offset or address (what `arg0` holds).
    pub fn value(&self) -> u64 {
        match *self {
            Source::Heap(v) | Source::Address(v) => v,
        }
    }

    /// Whether this is a [`Source::Address`].
    pub fn is_address(&self) -> bool {
        matches!(self, Source::Address(_))
    }

    /// The same space at `value + delta`, or `None` on overflow.
    pub fn checked_add(&self, delta: u64) -> Option<Source> {
        match *self {
            Source::Heap(v) => v.checked_add(delta).map(Source::Heap),
            Source::Address(v) => v.checked_add(delta).map(Source::Address),
        }
    }
}

/// Move `bytes` bytes from `src` (this rank's symmetric buffer, or a device address) to
/// `peer`'s symmetric buffer at `dst_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Destination rank.
    pub peer: u32,
    /// Where the bytes come from.
    pub src: Source,
    /// Destination offset in the peer's symmetric buffer.
    pub dst_offset: u64,
    /// Bytes to move (> 0).
    pub bytes: u64,
}

/// How a signal changes its word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// Store the value.
    Set,
    /// Add the value (wrapping), atomically with respect to other signals.
    Add,
}

/// Change a 64-bit word of `peer`'s symmetric buffer (a set: `words` consecutive words), after
/// every transfer and write to `peer` that came before it in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    /// Destination rank.
    pub peer: u32,
    /// Offset of the (first) word (multiple of [`SIGNAL_WORD_BYTES`]).
    pub offset: u64,
    /// The value.
    pub value: u64,
    /// Set or add.
    pub op: SignalOp,
    /// Words from `offset` on that a set stores `value` into (>= 1; an add: 1).
    pub words: u32,
}

impl Signal {
    /// One word at `offset` of `peer`'s buffer.
    pub fn word(peer: u32, offset: u64, value: u64, op: SignalOp) -> Signal {
        Signal {
            peer,
            offset,
            value,
            op,
            words: 1,
        }
    }

    /// Bytes the signal changes: `8 * words`.
    pub fn bytes(&self) -> u64 {
        SIGNAL_WORD_BYTES * u64::from(self.words)
    }
}

/// The width of a [`Write`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteWidth {
    /// 4 bytes (a float scale, an `int32` index).
    Four,
    /// 8 bytes (an `int64` top-k id).
    Eight,
}

impl WriteWidth {
    /// Bytes stored: 4 or 8.
    pub fn bytes(self) -> u64 {
        match self {
            WriteWidth::Four => 4,
            WriteWidth::Eight => 8,
        }
    }

    /// The width of `bytes` bytes, if it is 4 or 8.
    pub fn from_bytes(bytes: u64) -> Option<WriteWidth> {
        match bytes {
            4 => Some(WriteWidth::Four),
            8 => Some(WriteWidth::Eight),
            _ => None,
        }
    }
}

/// Store small values into `peer`'s symmetric buffer from `offset` on: `count` consecutive
/// elements `value, value + 1, ...` (each its low [`WriteWidth::bytes`] bytes, little-endian).
/// A kernel's single-element put (`count` 1), or a run of consecutive indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    /// Destination rank.
    pub peer: u32,
    /// Destination offset in the peer's symmetric buffer (multiple of the width).
    pub offset: u64,
    /// The first value, zero-extended; `value + count - 1` fits in the width.
    pub value: u64,
    /// 4 or 8 bytes.
    pub width: WriteWidth,
    /// Elements (>= 1).
    pub count: u32,
}

impl Write {
    /// One element.
    pub fn one(peer: u32, offset: u64, value: u64, width: WriteWidth) -> Write {
        Write {
            peer,
            offset,
            value,
            width,
            count: 1,
        }
    }

    /// Bytes stored: `width * count`.
    pub fn bytes(&self) -> u64 {
        self.width.bytes() * u64::from(self.count)
    }

    /// Element `j`'s value (`value + j`, wrapping: in a valid write it never wraps).
    pub fn element(&self, j: u32) -> u64 {
        self.value.wrapping_add(u64::from(j))
    }

    /// The stored bytes ([`Write::bytes`] of them), little-endian, element after element;
    /// an iterator, so that an executor writes them where they go without a copy between.
    pub fn le_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        let w = self.width.bytes() as usize;
        (0..self.count).flat_map(move |j| self.element(j).to_le_bytes().into_iter().take(w))
    }
}

/// A decoded, validated descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Descriptor {
    /// See [`Transfer`].
    Transfer(Transfer),
    /// See [`Signal`].
    Signal(Signal),
    /// See [`Write`].
    Write(Write),
}

impl Descriptor {
    /// The destination rank.
    pub fn peer(&self) -> u32 {
        match self {
            Descriptor::Transfer(t) => t.peer,
            Descriptor::Signal(s) => s.peer,
            Descriptor::Write(w) => w.peer,
        }
    }

    /// The raw record, after checking the rules of the [module docs](self) against `limits`.
    ///
    /// # Errors
    /// The first rule broken, naming the field.
    pub fn encode(&self, limits: &Limits) -> Result<RawDescriptor, DescriptorError> {
        let raw = match *self {
            Descriptor::Transfer(t) => RawDescriptor {
                kind: KIND_TRANSFER,
                flags: match t.src {
                    Source::Heap(_) => 0,
                    Source::Address(_) => TRANSFER_FLAG_SRC_ADDRESS,
                },
                peer: t.peer,
                arg0: t.src.value(),
                arg1: t.dst_offset,
                arg2: t.bytes,
            },
            Descriptor::Signal(s) => RawDescriptor {
                kind: KIND_SIGNAL,
                flags: match s.op {
                    SignalOp::Set => 0,
                    SignalOp::Add => SIGNAL_FLAG_ADD,
                },
                peer: s.peer,
                arg0: s.offset,
                arg1: s.value,
                // One word as the kernels write it (0); `words` 0 is refused below.
                arg2: match s.words {
                    1 => 0,
                    0 => return Err(DescriptorError::EmptySignal),
                    n => u64::from(n),
                },
            },
            Descriptor::Write(w) => RawDescriptor {
                kind: KIND_WRITE,
                flags: if w.count == 1 { 0 } else { WRITE_FLAG_SEQUENCE },
                peer: w.peer,
                arg0: w.offset,
                arg1: w.value,
                arg2: w.width.bytes()
                    | if w.count == 1 {
                        0
                    } else {
                        u64::from(w.count) << 32
                    },
            },
        };
        raw.decode(limits)?;
        Ok(raw)
    }
}

/// `[offset, offset + bytes)` fits in `heap_bytes` (without overflowing).
fn check_range(field: Field, offset: u64, bytes: u64, heap: u64) -> Result<(), DescriptorError> {
    match offset.checked_add(bytes) {
        Some(end) if end <= heap => Ok(()),
        _ => Err(DescriptorError::OutOfBounds {
            field,
            offset,
            bytes,
            heap_bytes: heap,
        }),
    }
}

/// `offset` is a multiple of `align`.
fn check_aligned(field: Field, offset: u64, align: u64) -> Result<(), DescriptorError> {
    if offset.is_multiple_of(align) {
        Ok(())
    } else {
        Err(DescriptorError::Misaligned {
            field,
            value: offset,
            align,
        })
    }
}

impl RawDescriptor {
    /// The typed descriptor, after checking every rule of the [module docs](self) against
    /// `limits`.
    ///
    /// # Errors
    /// The first rule broken, naming the field. Checked in field order (`kind`, `flags`,
    /// `peer`, then the arguments), except that a transfer's `arg2` (bytes), a signal's `arg2`
    /// (words) and a write's `arg2` (width and count) come before the ranges and alignment
    /// they determine.
    pub fn decode(&self, limits: &Limits) -> Result<Descriptor, DescriptorError> {
        let allowed_flags = match self.kind {
            KIND_TRANSFER => TRANSFER_FLAG_SRC_ADDRESS,
            KIND_SIGNAL => SIGNAL_FLAG_ADD,
            KIND_WRITE => WRITE_FLAG_SEQUENCE,
            value => return Err(DescriptorError::UnknownKind { value }),
        };
        if self.flags & !allowed_flags != 0 {
            return Err(DescriptorError::Reserved {
                field: Field::Flags,
                value: u64::from(self.flags),
            });
        }
        if self.peer >= limits.world {
            return Err(DescriptorError::PeerOutOfRange {
                peer: self.peer,
                world: limits.world,
            });
        }
        match self.kind {
            KIND_TRANSFER => self.decode_transfer(limits.heap_bytes),
            KIND_SIGNAL => self.decode_signal(limits.heap_bytes),
            _ => self.decode_write(limits.heap_bytes),
        }
    }

    fn decode_transfer(&self, heap: u64) -> Result<Descriptor, DescriptorError> {
        if self.arg2 == 0 {
            return Err(DescriptorError::EmptyTransfer);
        }
        let src = if self.flags & TRANSFER_FLAG_SRC_ADDRESS != 0 {
            if self.arg0 == 0 {
                return Err(DescriptorError::NullAddress);
            }
            if self.arg0.checked_add(self.arg2).is_none() {
                return Err(DescriptorError::AddressWraps {
                    address: self.arg0,
                    bytes: self.arg2,
                });
            }
            Source::Address(self.arg0)
        } else {
            check_range(Field::SrcOffset, self.arg0, self.arg2, heap)?;
            Source::Heap(self.arg0)
        };
        check_range(Field::DstOffset, self.arg1, self.arg2, heap)?;
        Ok(Descriptor::Transfer(Transfer {
            peer: self.peer,
            src,
            dst_offset: self.arg1,
            bytes: self.arg2,
        }))
    }

    fn decode_signal(&self, heap: u64) -> Result<Descriptor, DescriptorError> {
        let add = self.flags & SIGNAL_FLAG_ADD != 0;
        if add && self.arg2 > 1 {
            return Err(DescriptorError::AddToWords { words: self.arg2 });
        }
        let Ok(words) = u32::try_from(self.arg2.max(1)) else {
            return Err(DescriptorError::Reserved {
                field: Field::SignalWords,
                value: self.arg2,
            });
        };
        check_aligned(Field::SignalOffset, self.arg0, SIGNAL_WORD_BYTES)?;
        check_range(
            Field::SignalOffset,
            self.arg0,
            SIGNAL_WORD_BYTES * u64::from(words),
            heap,
        )?;
        Ok(Descriptor::Signal(Signal {
            peer: self.peer,
            offset: self.arg0,
            value: self.arg1,
            op: if add { SignalOp::Add } else { SignalOp::Set },
            words,
        }))
    }

    fn decode_write(&self, heap: u64) -> Result<Descriptor, DescriptorError> {
        let Some(width) = WriteWidth::from_bytes(self.arg2 & 0xffff_ffff) else {
            return Err(DescriptorError::InvalidWidth {
                value: self.arg2 & 0xffff_ffff,
            });
        };
        let count = (self.arg2 >> 32) as u32;
        let count = if self.flags & WRITE_FLAG_SEQUENCE != 0 {
            if count == 0 {
                return Err(DescriptorError::EmptySequence);
            }
            count
        } else if count != 0 {
            return Err(DescriptorError::Reserved {
                field: Field::WriteCount,
                value: u64::from(count),
            });
        } else {
            1
        };
        let bytes = width.bytes();
        check_aligned(Field::WriteOffset, self.arg0, bytes)?;
        check_range(
            Field::WriteOffset,
            self.arg0,
            bytes * u64::from(count),
            heap,
        )?;
        let max = match width {
            WriteWidth::Four => u64::from(u32::MAX),
            WriteWidth::Eight => u64::MAX,
        };
        if self.arg1 > max {
            return Err(DescriptorError::ValueTooWide {
                value: self.arg1,
                width: bytes,
            });
        }
        if max - self.arg1 < u64::from(count - 1) {
            return Err(DescriptorError::SequenceTooWide {
                value: self.arg1,
                count,
                width: bytes,
            });
        }
        Ok(Descriptor::Write(Write {
            peer: self.peer,
            offset: self.arg0,
            value: self.arg1,
            width,
            count,
        }))
    }

    /// The record as the four 64-bit words the ring stores (its little-endian memory image).
    pub fn to_words(&self) -> [u64; 4] {
        [
            u64::from(self.kind) | u64::from(self.flags) << 16 | u64::from(self.peer) << 32,
            self.arg0,
            self.arg1,
            self.arg2,
        ]
    }

    /// The inverse of [`RawDescriptor::to_words`].
    pub fn from_words(words: [u64; 4]) -> RawDescriptor {
        RawDescriptor {
            kind: (words[0] & 0xffff) as u16,
            flags: ((words[0] >> 16) & 0xffff) as u16,
            peer: (words[0] >> 32) as u32,
            arg0: words[1],
            arg1: words[2],
            arg2: words[3],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        world: 4,
        heap_bytes: 1 << 20,
    };

    fn transfer(peer: u32, src: u64, dst: u64, bytes: u64) -> Descriptor {
        Descriptor::Transfer(Transfer {
            peer,
            src: Source::Heap(src),
            dst_offset: dst,
            bytes,
        })
    }

    fn transfer_from(peer: u32, address: u64, dst: u64, bytes: u64) -> Descriptor {
        Descriptor::Transfer(Transfer {
            peer,
            src: Source::Address(address),
            dst_offset: dst,
            bytes,
        })
    }

    fn signal(peer: u32, offset: u64, value: u64, op: SignalOp) -> Descriptor {
        Descriptor::Signal(Signal::word(peer, offset, value, op))
    }

    fn signal_words(peer: u32, offset: u64, value: u64, words: u32) -> Descriptor {
        Descriptor::Signal(Signal {
            words,
            ..Signal::word(peer, offset, value, SignalOp::Set)
        })
    }

    fn write(peer: u32, offset: u64, value: u64, width: WriteWidth) -> Descriptor {
        Descriptor::Write(Write::one(peer, offset, value, width))
    }

    fn sequence(peer: u32, offset: u64, value: u64, width: WriteWidth, count: u32) -> Descriptor {
        Descriptor::Write(Write {
            count,
            ..Write::one(peer, offset, value, width)
        })
    }

    #[test]
    fn layout_matches_the_documented_bytes() {
        let raw = RawDescriptor {
            kind: 0x0102,
            flags: 0x0304,
            peer: 0x0506_0708,
            arg0: 0x1111_1111_1111_1111,
            arg1: 0x2222_2222_2222_2222,
            arg2: 0x3333_3333_3333_3333,
        };
        let bytes = bytemuck::bytes_of(&raw);
        assert_eq!(&bytes[0..2], &0x0102u16.to_le_bytes());
        assert_eq!(&bytes[2..4], &0x0304u16.to_le_bytes());
        assert_eq!(&bytes[4..8], &0x0506_0708u32.to_le_bytes());
        assert_eq!(&bytes[8..16], &raw.arg0.to_le_bytes());
        assert_eq!(&bytes[24..32], &raw.arg2.to_le_bytes());
        let words: Vec<u8> = raw
            .to_words()
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        assert_eq!(words.as_slice(), bytes);
        assert_eq!(RawDescriptor::from_words(raw.to_words()), raw);
    }

    #[test]
    fn valid_descriptors_round_trip() {
        for d in [
            transfer(3, 0, 4096, 7168),
            transfer(0, (1 << 20) - 1, 0, 1),
            // An address source is not bounded by the heap, only the destination is.
            transfer_from(1, 0x7f00_dead_0000, 0, 1 << 20),
            transfer_from(2, u64::MAX - 8, 64, 8),
            signal(1, 8, u64::MAX, SignalOp::Set),
            signal(2, (1 << 20) - 8, 5, SignalOp::Add),
            write(1, 4, u64::from(u32::MAX), WriteWidth::Four),
            write(3, (1 << 20) - 4, 0, WriteWidth::Four),
            write(2, 16, u64::MAX, WriteWidth::Eight),
            write(0, (1 << 20) - 8, 42, WriteWidth::Eight),
            signal_words(1, 64, 7, 2),
            signal_words(3, (1 << 20) - 8 * 300, u64::MAX, 300),
            sequence(2, 8, 100, WriteWidth::Four, 2),
            sequence(
                1,
                (1 << 20) - 4 * 256,
                u64::from(u32::MAX) - 255,
                WriteWidth::Four,
                256,
            ),
            sequence(0, 16, u64::MAX - 2, WriteWidth::Eight, 3),
        ] {
            let raw = d.encode(&LIMITS).expect("valid");
            assert_eq!(raw.decode(&LIMITS), Ok(d));
            assert_eq!(RawDescriptor::from_words(raw.to_words()), raw);
        }
        let raw = signal(1, 8, 1, SignalOp::Add)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(
            (raw.kind, raw.flags, raw.arg2),
            (KIND_SIGNAL, SIGNAL_FLAG_ADD, 0)
        );
        let raw = transfer_from(1, 0x1000, 8, 16)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(
            (raw.kind, raw.flags, raw.arg0, raw.arg1, raw.arg2),
            (KIND_TRANSFER, TRANSFER_FLAG_SRC_ADDRESS, 0x1000, 8, 16)
        );
        let raw = transfer(1, 0x1000, 8, 16).encode(&LIMITS).expect("valid");
        assert_eq!((raw.kind, raw.flags), (KIND_TRANSFER, 0));
        let raw = write(2, 12, 0xabcd, WriteWidth::Four)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(
            (raw.kind, raw.flags, raw.peer, raw.arg0, raw.arg1, raw.arg2),
            (KIND_WRITE, 0, 2, 12, 0xabcd, 4)
        );
        // A sequence of one is a plain write; a longer one carries the flag and its count.
        assert_eq!(
            sequence(2, 12, 0xabcd, WriteWidth::Four, 1).encode(&LIMITS),
            Ok(raw)
        );
        let raw = sequence(2, 12, 7, WriteWidth::Four, 5)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(
            (raw.flags, raw.arg1, raw.arg2),
            (WRITE_FLAG_SEQUENCE, 7, 4 | 5 << 32)
        );
        // One signal word is recorded as the kernels write it (arg2 0), and 1 reads the same.
        let one = signal(1, 8, 9, SignalOp::Set)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(one.arg2, 0);
        assert_eq!(
            RawDescriptor { arg2: 1, ..one }.decode(&LIMITS),
            one.decode(&LIMITS)
        );
        let raw = signal_words(1, 8, 9, 4).encode(&LIMITS).expect("valid");
        assert_eq!((raw.flags, raw.arg2), (0, 4));
    }

    #[test]
    fn sequences_and_signal_words_store_what_they_say() {
        let Descriptor::Write(w) = sequence(0, 0, 0xffff_fffe, WriteWidth::Four, 2) else {
            unreachable!()
        };
        assert_eq!(w.bytes(), 8);
        assert_eq!(
            w.le_bytes().collect::<Vec<_>>(),
            [0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
        let Descriptor::Write(w) = sequence(0, 0, 5, WriteWidth::Eight, 3) else {
            unreachable!()
        };
        let want: Vec<u8> = [5u64, 6, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(w.le_bytes().collect::<Vec<_>>(), want);
        assert_eq!(
            Write::one(0, 0, 9, WriteWidth::Four)
                .le_bytes()
                .collect::<Vec<_>>(),
            9u32.to_le_bytes()
        );
        let Descriptor::Signal(s) = signal_words(0, 8, 1, 3) else {
            unreachable!()
        };
        assert_eq!(s.bytes(), 24);
    }

    #[test]
    fn every_rule_names_its_field() {
        let raw = |kind, flags, peer, arg0, arg1, arg2| RawDescriptor {
            kind,
            flags,
            peer,
            arg0,
            arg1,
            arg2,
        };
        let heap = LIMITS.heap_bytes;
        let addr = TRANSFER_FLAG_SRC_ADDRESS;
        let cases = [
            (
                raw(0, 0, 0, 0, 0, 1),
                DescriptorError::UnknownKind { value: 0 },
            ),
            (
                raw(9, 0, 0, 0, 0, 1),
                DescriptorError::UnknownKind { value: 9 },
            ),
            (
                raw(KIND_TRANSFER, 2, 0, 0, 0, 1),
                DescriptorError::Reserved {
                    field: Field::Flags,
                    value: 2,
                },
            ),
            (
                raw(KIND_SIGNAL, 2, 0, 0, 0, 0),
                DescriptorError::Reserved {
                    field: Field::Flags,
                    value: 2,
                },
            ),
            (
                raw(KIND_WRITE, 2, 0, 0, 0, 4),
                DescriptorError::Reserved {
                    field: Field::Flags,
                    value: 2,
                },
            ),
            (
                raw(KIND_TRANSFER, 0, 4, 0, 0, 1),
                DescriptorError::PeerOutOfRange { peer: 4, world: 4 },
            ),
            (
                raw(KIND_WRITE, 0, 7, 0, 0, 4),
                DescriptorError::PeerOutOfRange { peer: 7, world: 4 },
            ),
            (
                raw(KIND_TRANSFER, 0, 0, 0, 0, 0),
                DescriptorError::EmptyTransfer,
            ),
            (
                raw(KIND_TRANSFER, addr, 0, 0x1000, 0, 0),
                DescriptorError::EmptyTransfer,
            ),
            (
                raw(KIND_TRANSFER, 0, 0, heap, 0, 1),
                DescriptorError::OutOfBounds {
                    field: Field::SrcOffset,
                    offset: heap,
                    bytes: 1,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_TRANSFER, addr, 0, 0, 0, 8),
                DescriptorError::NullAddress,
            ),
            (
                raw(KIND_TRANSFER, addr, 0, u64::MAX - 3, 0, 8),
                DescriptorError::AddressWraps {
                    address: u64::MAX - 3,
                    bytes: 8,
                },
            ),
            (
                raw(KIND_TRANSFER, 0, 0, 0, u64::MAX, 2),
                DescriptorError::OutOfBounds {
                    field: Field::DstOffset,
                    offset: u64::MAX,
                    bytes: 2,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_TRANSFER, addr, 0, 0x1000, heap - 4, 8),
                DescriptorError::OutOfBounds {
                    field: Field::DstOffset,
                    offset: heap - 4,
                    bytes: 8,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_SIGNAL, 0, 0, 12, 0, 0),
                DescriptorError::Misaligned {
                    field: Field::SignalOffset,
                    value: 12,
                    align: 8,
                },
            ),
            (
                raw(KIND_SIGNAL, 0, 0, heap, 0, 0),
                DescriptorError::OutOfBounds {
                    field: Field::SignalOffset,
                    offset: heap,
                    bytes: 8,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_SIGNAL, SIGNAL_FLAG_ADD, 0, 0, 0, 2),
                DescriptorError::AddToWords { words: 2 },
            ),
            (
                raw(KIND_SIGNAL, 0, 0, 0, 0, 1 << 32),
                DescriptorError::Reserved {
                    field: Field::SignalWords,
                    value: 1 << 32,
                },
            ),
            (
                raw(KIND_SIGNAL, 0, 0, heap - 16, 0, 3),
                DescriptorError::OutOfBounds {
                    field: Field::SignalOffset,
                    offset: heap - 16,
                    bytes: 24,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, 0, 0, 4 | 2 << 32),
                DescriptorError::Reserved {
                    field: Field::WriteCount,
                    value: 2,
                },
            ),
            (
                raw(KIND_WRITE, WRITE_FLAG_SEQUENCE, 0, 0, 0, 4),
                DescriptorError::EmptySequence,
            ),
            (
                raw(KIND_WRITE, WRITE_FLAG_SEQUENCE, 0, heap - 8, 0, 4 | 3 << 32),
                DescriptorError::OutOfBounds {
                    field: Field::WriteOffset,
                    offset: heap - 8,
                    bytes: 12,
                    heap_bytes: heap,
                },
            ),
            (
                raw(
                    KIND_WRITE,
                    WRITE_FLAG_SEQUENCE,
                    0,
                    0,
                    u64::from(u32::MAX) - 1,
                    4 | 3 << 32,
                ),
                DescriptorError::SequenceTooWide {
                    value: u64::from(u32::MAX) - 1,
                    count: 3,
                    width: 4,
                },
            ),
            (
                raw(KIND_WRITE, WRITE_FLAG_SEQUENCE, 0, 0, u64::MAX, 8 | 2 << 32),
                DescriptorError::SequenceTooWide {
                    value: u64::MAX,
                    count: 2,
                    width: 8,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, 0, 0, 0),
                DescriptorError::InvalidWidth { value: 0 },
            ),
            (
                raw(KIND_WRITE, 0, 0, 0, 0, 2),
                DescriptorError::InvalidWidth { value: 2 },
            ),
            (
                raw(KIND_WRITE, 0, 0, 6, 0, 4),
                DescriptorError::Misaligned {
                    field: Field::WriteOffset,
                    value: 6,
                    align: 4,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, 12, 0, 8),
                DescriptorError::Misaligned {
                    field: Field::WriteOffset,
                    value: 12,
                    align: 8,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, heap, 0, 4),
                DescriptorError::OutOfBounds {
                    field: Field::WriteOffset,
                    offset: heap,
                    bytes: 4,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, u64::MAX - 7, 0, 8),
                DescriptorError::OutOfBounds {
                    field: Field::WriteOffset,
                    offset: u64::MAX - 7,
                    bytes: 8,
                    heap_bytes: heap,
                },
            ),
            (
                raw(KIND_WRITE, 0, 0, 0, 1 << 32, 4),
                DescriptorError::ValueTooWide {
                    value: 1 << 32,
                    width: 4,
                },
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(raw.decode(&LIMITS), Err(want.clone()), "{raw:?}");
        }
        assert!(
            transfer(0, 0, 12, 0)
                .encode(&LIMITS)
                .is_err_and(|e| e == DescriptorError::EmptyTransfer)
        );
        // `encode` applies the same rules as `decode`.
        assert_eq!(
            transfer_from(0, 0, 0, 8).encode(&LIMITS),
            Err(DescriptorError::NullAddress)
        );
        assert_eq!(
            write(1, 0, u64::from(u32::MAX) + 1, WriteWidth::Four).encode(&LIMITS),
            Err(DescriptorError::ValueTooWide {
                value: 1 << 32,
                width: 4
            })
        );
        assert!(matches!(
            write(1, 4, 0, WriteWidth::Eight).encode(&LIMITS),
            Err(DescriptorError::Misaligned {
                field: Field::WriteOffset,
                ..
            })
        ));
        assert_eq!(
            sequence(1, 0, 0, WriteWidth::Four, 0).encode(&LIMITS),
            Err(DescriptorError::EmptySequence)
        );
        assert_eq!(
            signal_words(1, 0, 0, 0).encode(&LIMITS),
            Err(DescriptorError::EmptySignal)
        );
        assert_eq!(
            Descriptor::Signal(Signal {
                words: 2,
                ..Signal::word(1, 0, 1, SignalOp::Add)
            })
            .encode(&LIMITS),
            Err(DescriptorError::AddToWords { words: 2 })
        );
    }

    #[test]
    fn messages_name_the_field() {
        for (err, field) in [
            (DescriptorError::EmptyTransfer, "arg2 (transfer bytes)"),
            (
                DescriptorError::NullAddress,
                "arg0 (transfer source address)",
            ),
            (
                DescriptorError::AddressWraps {
                    address: u64::MAX,
                    bytes: 1,
                },
                "arg0 (transfer source address)",
            ),
            (
                DescriptorError::InvalidWidth { value: 3 },
                "arg2 bits 0..31 (write width)",
            ),
            (
                DescriptorError::EmptySequence,
                "arg2 bits 32..63 (write sequence count)",
            ),
            (
                DescriptorError::AddToWords { words: 2 },
                "arg2 (signal words)",
            ),
            (
                DescriptorError::ValueTooWide {
                    value: 1 << 40,
                    width: 4,
                },
                "arg1 (write value)",
            ),
            (
                DescriptorError::Misaligned {
                    field: Field::WriteOffset,
                    value: 2,
                    align: 4,
                },
                "arg0 (write destination offset)",
            ),
        ] {
            let msg = err.to_string();
            assert!(msg.contains(field), "{msg}");
        }
    }

    #[test]
    fn write_widths_and_sources() {
        assert_eq!(WriteWidth::from_bytes(4), Some(WriteWidth::Four));
        assert_eq!(WriteWidth::from_bytes(8), Some(WriteWidth::Eight));
        assert_eq!(WriteWidth::from_bytes(2), None);
        assert_eq!(WriteWidth::Eight.bytes(), 8);
        assert_eq!(Source::Heap(7).checked_add(1), Some(Source::Heap(8)));
        assert_eq!(
            Source::Address(u64::MAX).checked_add(1),
            None,
            "overflow is None"
        );
        assert!(Source::Address(1).is_address() && !Source::Heap(1).is_address());
        assert_eq!(Source::Address(9).value(), 9);
    }
}
