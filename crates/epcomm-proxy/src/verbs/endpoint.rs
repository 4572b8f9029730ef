//! Queue pair connection information and its byte form, exchanged by the caller's bootstrap
//! all-gather.
//!
//! Each rank publishes one [`RankEndpoints`]: its rank, the world size, the symmetric buffer's
//! size and, for every peer `p` (itself included), the [`QpEndpoint`] of its queue pair to `p`.
//! Rank `r` connects its queue pair to `p` to `endpoints[r]` of rank `p`'s record.
//!
//! Byte form (little-endian): `magic` `b"EPQP"` (4), `version` u16 = 1, reserved u16 = 0,
//! `rank` u32, `world` u32, `heap_bytes` u64, then `world` endpoints of
//! [`QpEndpoint::BYTES`] bytes: `qpn` u32, `psn` u32, `gid` 16 bytes (network order), `lid`
//! u16, reserved u16, `rkey` u32, `base_addr` u64.

/// What a peer needs to connect to, and write into, one queue pair of this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpEndpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// The port's GID at the selected index (network order; used on RoCE and across subnets).
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The symmetric buffer's remote key.
    pub rkey: u32,
    /// The address peers write at for offset 0 (the buffer's address, or its IOVA for a
    /// dma-buf registration).
    pub base_addr: u64,
}

impl QpEndpoint {
    /// Bytes of one endpoint.
    pub const BYTES: usize = 40;

    /// The byte form.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..24].copy_from_slice(&self.gid);
        b[24..26].copy_from_slice(&self.lid.to_le_bytes());
        b[28..32].copy_from_slice(&self.rkey.to_le_bytes());
        b[32..40].copy_from_slice(&self.base_addr.to_le_bytes());
        b
    }

    /// The inverse of [`QpEndpoint::to_bytes`].
    pub fn from_bytes(b: &[u8; Self::BYTES]) -> QpEndpoint {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&b[32..40]);
        QpEndpoint {
            qpn: u32_at(0),
            psn: u32_at(4),
            gid,
            lid: u16::from_le_bytes([b[24], b[25]]),
            rkey: u32_at(28),
            base_addr: u64::from_le_bytes(addr),
        }
    }
}

/// One rank's endpoints, one per peer (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEndpoints {
    /// The publishing rank.
    pub rank: u32,
    /// The world size.
    pub world: u32,
    /// The symmetric buffer's size on that rank.
    pub heap_bytes: u64,
    /// `endpoints[p]`: the queue pair to peer `p`.
    pub endpoints: Vec<QpEndpoint>,
}

/// A peer's record is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// Wrong length.
    #[error(
        "endpoint record {index} is {found} bytes: must be {expected} (header 24 + {world} x {})",
        QpEndpoint::BYTES
    )]
    Length {
        /// Its position in the all-gather.
        index: usize,
        /// Its length.
        found: usize,
        /// The length for `world` endpoints.
        expected: usize,
        /// The world size.
        world: u32,
    },
    /// Not an endpoint record.
    #[error("endpoint record {index}: magic is {found:02x?}, must be \"EPQP\"")]
    Magic {
        /// Its position.
        index: usize,
        /// The bytes found.
        found: [u8; 4],
    },
    /// Another format version.
    #[error(
        "endpoint record {index}: version {found}, must be {}",
        RankEndpoints::VERSION
    )]
    Version {
        /// Its position.
        index: usize,
        /// The version found.
        found: u16,
    },
    /// The all-gather returned another number of records than the world size.
    #[error("the all-gather returned {found} endpoint records: must be one per rank ({world})")]
    Count {
        /// Records returned.
        found: usize,
        /// The world size.
        world: u32,
    },
    /// A record is from another rank than its position, or another world.
    #[error(
        "endpoint record {index} says rank {rank} of {world}: must be rank {index} of {expected_world}"
    )]
    Rank {
        /// Its position.
        index: usize,
        /// The rank it names.
        rank: u32,
        /// The world it names.
        world: u32,
        /// This rank's world size.
        expected_world: u32,
    },
    /// The symmetric buffer sizes differ.
    #[error(
        "rank {rank}'s symmetric buffer is {found} bytes, this rank's {expected}: must be equal"
    )]
    HeapBytes {
        /// The rank.
        rank: u32,
        /// Its size.
        found: u64,
        /// This rank's size.
        expected: u64,
    },
}

impl RankEndpoints {
    /// The format version.
    pub const VERSION: u16 = 1;
    /// Header bytes.
    pub const HEADER_BYTES: usize = 24;
    const MAGIC: [u8; 4] = *b"EPQP";

    /// The byte form.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b =
            Vec::with_capacity(Self::HEADER_BYTES + self.endpoints.len() * QpEndpoint::BYTES);
        b.extend_from_slice(&Self::MAGIC);
        b.extend_from_slice(&Self::VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.heap_bytes.to_le_bytes());
        for e in &self.endpoints {
            b.extend_from_slice(&e.to_bytes());
        }
        b
    }

    /// Parses record `index` of an all-gather over `world` ranks.
    ///
    /// # Errors
    /// [`EndpointError::Length`], [`EndpointError::Magic`], [`EndpointError::Version`],
    /// [`EndpointError::Rank`] (the record names another rank than `index`, or another world).
    pub fn from_bytes(index: usize, world: u32, b: &[u8]) -> Result<RankEndpoints, EndpointError> {
        let expected = Self::HEADER_BYTES + world as usize * QpEndpoint::BYTES;
        if b.len() < Self::HEADER_BYTES {
            return Err(EndpointError::Length {
                index,
                found: b.len(),
                expected,
                world,
            });
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != Self::MAGIC {
            return Err(EndpointError::Magic {
                index,
                found: magic,
            });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != Self::VERSION {
            return Err(EndpointError::Version {
                index,
                found: version,
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (rank, their_world) = (u32_at(8), u32_at(12));
        if rank as usize != index || their_world != world {
            return Err(EndpointError::Rank {
                index,
                rank,
                world: their_world,
                expected_world: world,
            });
        }
        if b.len() != expected {
            return Err(EndpointError::Length {
                index,
                found: b.len(),
                expected,
                world,
            });
        }
        let mut heap = [0u8; 8];
        heap.copy_from_slice(&b[16..24]);
        let endpoints = b[Self::HEADER_BYTES..]
            .chunks_exact(QpEndpoint::BYTES)
            .map(|c| {
                let mut e = [0u8; QpEndpoint::BYTES];
                e.copy_from_slice(c);
                QpEndpoint::from_bytes(&e)
            })
            .collect();
        Ok(RankEndpoints {
            rank,
            world,
            heap_bytes: u64::from_le_bytes(heap),
            endpoints,
        })
    }

    /// Parses a whole all-gather (`records[r]` from rank `r`) and checks that every buffer
    /// has `heap_bytes` bytes.
    ///
    /// # Errors
    /// [`EndpointError::Count`], [`EndpointError::HeapBytes`], and those of
    /// [`RankEndpoints::from_bytes`].
    pub fn parse_all(
        world: u32,
        heap_bytes: u64,
        records: &[Vec<u8>],
    ) -> Result<Vec<RankEndpoints>, EndpointError> {
        if records.len() != world as usize {
            return Err(EndpointError::Count {
                found: records.len(),
                world,
            });
        }
        let all = records
            .iter()
            .enumerate()
            .map(|(i, b)| RankEndpoints::from_bytes(i, world, b))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(bad) = all.iter().find(|r| r.heap_bytes != heap_bytes) {
            return Err(EndpointError::HeapBytes {
                rank: bad.rank,
                found: bad.heap_bytes,
                expected: heap_bytes,
            });
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rank: u32, world: u32) -> RankEndpoints {
        RankEndpoints {
            rank,
            world,
            heap_bytes: 1 << 30,
            endpoints: (0..world)
                .map(|p| QpEndpoint {
                    qpn: 0x00ab_cd00 + p,
                    psn: 0x00ff_fff0 - p,
                    gid: [
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, rank as u8, p as u8,
                    ],
                    lid: 0x1234,
                    rkey: 0xdead_beef ^ rank,
                    base_addr: 0x7f00_0000_0000 + u64::from(rank),
                })
                .collect(),
        }
    }

    #[test]
    fn endpoint_round_trips_with_the_documented_layout() {
        let e = sample(1, 2).endpoints[1];
        let b = e.to_bytes();
        assert_eq!(&b[0..4], &e.qpn.to_le_bytes());
        assert_eq!(&b[8..24], &e.gid);
        assert_eq!(&b[26..28], &[0, 0]);
        assert_eq!(&b[32..40], &e.base_addr.to_le_bytes());
        assert_eq!(QpEndpoint::from_bytes(&b), e);
    }

    #[test]
    fn rank_records_round_trip() {
        for world in [1, 2, 8] {
            let records: Vec<Vec<u8>> = (0..world).map(|r| sample(r, world).to_bytes()).collect();
            assert_eq!(
                records[0].len(),
                RankEndpoints::HEADER_BYTES + world as usize * QpEndpoint::BYTES
            );
            let all = RankEndpoints::parse_all(world, 1 << 30, &records).expect("valid");
            for (r, parsed) in all.iter().enumerate() {
                assert_eq!(parsed, &sample(r as u32, world));
            }
        }
    }

    #[test]
    fn bad_records_name_their_position_and_rule() {
        let good = sample(1, 2).to_bytes();
        let err = RankEndpoints::from_bytes(1, 2, &good[..30]).expect_err("short");
        assert!(matches!(
            err,
            EndpointError::Length {
                index: 1,
                found: 30,
                expected: 104,
                ..
            }
        ));
        let err = RankEndpoints::from_bytes(1, 2, &good[..10]).expect_err("shorter");
        assert!(matches!(err, EndpointError::Length { found: 10, .. }));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            RankEndpoints::from_bytes(1, 2, &bad),
            Err(EndpointError::Magic { index: 1, .. })
        ));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(
            RankEndpoints::from_bytes(1, 2, &bad),
            Err(EndpointError::Version { index: 1, found: 2 })
        );
        let err = RankEndpoints::from_bytes(0, 2, &good).expect_err("wrong position");
        assert_eq!(
            err,
            EndpointError::Rank {
                index: 0,
                rank: 1,
                world: 2,
                expected_world: 2
            }
        );
        assert!(err.to_string().contains("must be rank 0 of 2"), "{err}");
        assert_eq!(
            RankEndpoints::parse_all(2, 1 << 30, std::slice::from_ref(&good)),
            Err(EndpointError::Count { found: 1, world: 2 })
        );
        let records = vec![sample(0, 2).to_bytes(), good];
        assert_eq!(
            RankEndpoints::parse_all(2, 4096, &records),
            Err(EndpointError::HeapBytes {
                rank: 0,
                found: 1 << 30,
                expected: 4096
            })
        );
    }
}
