//! The descriptor: one fixed-size, `#[repr(C)]` record per piece of work a kernel hands to the
//! proxy, and its validated encoding and decoding.
//!
//! # Layout (32 bytes, 8-byte aligned, little-endian; shared with the CUDA side)
//!
//! | bytes  | field   | bits | meaning |
//! |--------|---------|------|---------|
//! | 0..2   | `kind`  | 16   | [`KIND_TRANSFER`] (1) or [`KIND_SIGNAL`] (2); 0 and every other value are invalid |
//! | 2..4   | `flags` | 16   | transfer: must be 0; signal: bit 0 = [`SignalOp`] (0 = set, 1 = add), bits 1..15 must be 0 |
//! | 4..8   | `peer`  | 32   | destination rank, `< world` |
//! | 8..16  | `arg0`  | 64   | transfer: source offset in this rank's symmetric buffer; signal: offset of the destination's 64-bit signal word (multiple of 8) |
//! | 16..24 | `arg1`  | 64   | transfer: destination offset in the peer's symmetric buffer; signal: the value (stored, or added) |
//! | 24..32 | `arg2`  | 64   | transfer: bytes to move (> 0); signal: must be 0 |
//!
//! Offsets are byte offsets into the symmetric buffer (the same [`Limits::heap_bytes`] on every
//! rank); a range `[offset, offset + bytes)` must fit in it. As 64-bit words (what the ring
//! stores, [`RawDescriptor::to_words`]): word 0 = `kind | flags << 16 | peer << 32`, words 1..3 =
//! `arg0..arg2`.
//!
//! [`Descriptor::encode`] and [`RawDescriptor::decode`] apply the same rules; every violation is
//! a [`DescriptorError`] naming the [`Field`] and the rule.

use std::fmt;

/// `kind` of a transfer descriptor.
pub const KIND_TRANSFER: u16 = 1;
/// `kind` of a signal descriptor.
pub const KIND_SIGNAL: u16 = 2;
/// Bit of `flags` that selects [`SignalOp::Add`] in a signal descriptor.
pub const SIGNAL_FLAG_ADD: u16 = 1;
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
    /// [`KIND_TRANSFER`] or [`KIND_SIGNAL`].
    pub kind: u16,
    /// Kind-specific flags ([`SIGNAL_FLAG_ADD`]).
    pub flags: u16,
    /// Destination rank.
    pub peer: u32,
    /// Transfer: source offset. Signal: signal word offset.
    pub arg0: u64,
    /// Transfer: destination offset. Signal: value.
    pub arg1: u64,
    /// Transfer: bytes. Signal: 0.
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
    /// `arg0` of a transfer.
    SrcOffset,
    /// `arg1` of a transfer.
    DstOffset,
    /// `arg2` of a transfer.
    Bytes,
    /// `arg0` of a signal.
    SignalOffset,
    /// `arg2` of a signal (reserved).
    SignalReserved,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Field::Kind => "kind",
            Field::Flags => "flags",
            Field::Peer => "peer",
            Field::SrcOffset => "arg0 (transfer source offset)",
            Field::DstOffset => "arg1 (transfer destination offset)",
            Field::Bytes => "arg2 (transfer bytes)",
            Field::SignalOffset => "arg0 (signal word offset)",
            Field::SignalReserved => "arg2 (reserved in a signal)",
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
    /// `kind` is neither [`KIND_TRANSFER`] nor [`KIND_SIGNAL`].
    #[error("descriptor field `kind` is {value}: must be 1 (transfer) or 2 (signal)")]
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

/// Move `bytes` bytes from this rank's symmetric buffer to `peer`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Destination rank.
    pub peer: u32,
    /// Source offset in this rank's symmetric buffer.
    pub src_offset: u64,
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

/// Change a 64-bit word of `peer`'s symmetric buffer, after every transfer to `peer` that came
/// before it in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    /// Destination rank.
    pub peer: u32,
    /// Offset of the word (multiple of [`SIGNAL_WORD_BYTES`]).
    pub offset: u64,
    /// The value.
    pub value: u64,
    /// Set or add.
    pub op: SignalOp,
}

/// A decoded, validated descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Descriptor {
    /// See [`Transfer`].
    Transfer(Transfer),
    /// See [`Signal`].
    Signal(Signal),
}

impl Descriptor {
    /// The destination rank.
    pub fn peer(&self) -> u32 {
        match self {
            Descriptor::Transfer(t) => t.peer,
            Descriptor::Signal(s) => s.peer,
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
                flags: 0,
                peer: t.peer,
                arg0: t.src_offset,
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
                arg2: 0,
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

impl RawDescriptor {
    /// The typed descriptor, after checking every rule of the [module docs](self) against
    /// `limits`.
    ///
    /// # Errors
    /// The first rule broken, in field order, naming the field.
    pub fn decode(&self, limits: &Limits) -> Result<Descriptor, DescriptorError> {
        if self.kind != KIND_TRANSFER && self.kind != KIND_SIGNAL {
            return Err(DescriptorError::UnknownKind { value: self.kind });
        }
        let allowed_flags = if self.kind == KIND_SIGNAL {
            SIGNAL_FLAG_ADD
        } else {
            0
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
        let heap = limits.heap_bytes;
        if self.kind == KIND_TRANSFER {
            if self.arg2 == 0 {
                return Err(DescriptorError::EmptyTransfer);
            }
            check_range(Field::SrcOffset, self.arg0, self.arg2, heap)?;
            check_range(Field::DstOffset, self.arg1, self.arg2, heap)?;
            return Ok(Descriptor::Transfer(Transfer {
                peer: self.peer,
                src_offset: self.arg0,
                dst_offset: self.arg1,
                bytes: self.arg2,
            }));
        }
        if !self.arg0.is_multiple_of(SIGNAL_WORD_BYTES) {
            return Err(DescriptorError::Misaligned {
                field: Field::SignalOffset,
                value: self.arg0,
                align: SIGNAL_WORD_BYTES,
            });
        }
        check_range(Field::SignalOffset, self.arg0, SIGNAL_WORD_BYTES, heap)?;
        if self.arg2 != 0 {
            return Err(DescriptorError::Reserved {
                field: Field::SignalReserved,
                value: self.arg2,
            });
        }
        Ok(Descriptor::Signal(Signal {
            peer: self.peer,
            offset: self.arg0,
            value: self.arg1,
            op: if self.flags & SIGNAL_FLAG_ADD != 0 {
                SignalOp::Add
            } else {
                SignalOp::Set
            },
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
            src_offset: src,
            dst_offset: dst,
            bytes,
        })
    }

    fn signal(peer: u32, offset: u64, value: u64, op: SignalOp) -> Descriptor {
        Descriptor::Signal(Signal {
            peer,
            offset,
            value,
            op,
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
            signal(1, 8, u64::MAX, SignalOp::Set),
            signal(2, (1 << 20) - 8, 5, SignalOp::Add),
        ] {
            let raw = d.encode(&LIMITS).expect("valid");
            assert_eq!(raw.decode(&LIMITS), Ok(d));
        }
        let raw = signal(1, 8, 1, SignalOp::Add)
            .encode(&LIMITS)
            .expect("valid");
        assert_eq!(
            (raw.kind, raw.flags, raw.arg2),
            (KIND_SIGNAL, SIGNAL_FLAG_ADD, 0)
        );
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
                raw(KIND_TRANSFER, 1, 0, 0, 0, 1),
                DescriptorError::Reserved {
                    field: Field::Flags,
                    value: 1,
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
                raw(KIND_TRANSFER, 0, 4, 0, 0, 1),
                DescriptorError::PeerOutOfRange { peer: 4, world: 4 },
            ),
            (
                raw(KIND_TRANSFER, 0, 0, 0, 0, 0),
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
                raw(KIND_TRANSFER, 0, 0, 0, u64::MAX, 2),
                DescriptorError::OutOfBounds {
                    field: Field::DstOffset,
                    offset: u64::MAX,
                    bytes: 2,
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
                raw(KIND_SIGNAL, 0, 0, 0, 0, 7),
                DescriptorError::Reserved {
                    field: Field::SignalReserved,
                    value: 7,
                },
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(raw.decode(&LIMITS), Err(want.clone()), "{raw:?}");
        }
        let msg = DescriptorError::EmptyTransfer.to_string();
        assert!(msg.contains("arg2 (transfer bytes)"), "{msg}");
        assert!(
            transfer(0, 0, 12, 0)
                .encode(&LIMITS)
                .is_err_and(|e| e == DescriptorError::EmptyTransfer)
        );
    }
}
