//! Framing: a connection is a sequence of frames, each a `u32` little-endian body length
//! followed by that many body bytes.
//!
//! Contracts: [`write_frame`] writes a whole frame or fails (it never writes a body over
//! [`MAX_FRAME`]); [`FrameReader`] returns whole bodies only, keeps a partial frame across read
//! timeouts so reading may resume, and refuses a length prefix over its limit before reading the
//! body.

use std::io::{self, Read, Write};

use super::MAX_FRAME;

/// Writes one frame: `u32` little-endian body length, then the body.
pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "frame of {} bytes exceeds the {MAX_FRAME}-byte limit",
                    body.len()
                ),
            )
        })?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

/// [`write_frame`] to `stream` while holding `lock`, the stream's write lock, so frames of
/// concurrent writers never interleave. A poisoned lock is taken over: it guards no data, only
/// the order of whole frames.
pub(crate) fn write_frame_locked(
    lock: &std::sync::Mutex<()>,
    stream: &std::net::TcpStream,
    body: &[u8],
) -> io::Result<()> {
    let _guard = lock
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    write_frame(&mut &*stream, body)
}

/// Why [`FrameReader::read_frame`] returned no frame.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection at a frame boundary.
    Eof,
    /// The peer closed the connection in the middle of a frame.
    Truncated,
    /// The length prefix is larger than allowed.
    TooLarge { len: usize, max: usize },
    /// A socket error; `WouldBlock`/`TimedOut` mean the read timeout expired and the partial frame
    /// is kept, so reading may resume.
    Io(io::Error),
}

impl FrameError {
    /// True when the error is a read timeout (the reader stays usable).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, FrameError::Io(e)
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Eof => f.write_str("connection closed"),
            FrameError::Truncated => f.write_str("connection closed in the middle of a frame"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame length {len} exceeds the limit of {max} bytes")
            }
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Incremental frame reader that keeps partially received frames across read timeouts.
#[derive(Debug)]
pub(crate) struct FrameReader {
    buf: Vec<u8>,
    max: usize,
}

impl FrameReader {
    /// A reader accepting bodies of at most `max` bytes.
    pub(crate) fn new(max: usize) -> Self {
        FrameReader {
            buf: Vec::new(),
            max,
        }
    }

    /// Changes the body size limit (used once the handshake has completed).
    pub(crate) fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    fn take_buffered(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let body = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(body))
    }

    /// Returns the next complete frame body, reading from `r` as needed.
    pub(crate) fn read_frame(&mut self, r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
        loop {
            if let Some(body) = self.take_buffered()? {
                return Ok(body);
            }
            // Read at least 64 KiB at a time, or the rest of the current frame if larger.
            let pending = if self.buf.len() >= 4 {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
                (len as usize + 4).saturating_sub(self.buf.len())
            } else {
                0
            };
            let want = pending.max(64 * 1024);
            let old = self.buf.len();
            self.buf.resize(old + want, 0);
            let res = r.read(&mut self.buf[old..]);
            let got = *res.as_ref().unwrap_or(&0);
            self.buf.truncate(old + got);
            match res {
                Ok(0) if self.buf.is_empty() => return Err(FrameError::Eof),
                Ok(0) => return Err(FrameError::Truncated),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
    }
}

/// A reader that calls `on_progress` each time the underlying read returns data, so that a
/// large frame arriving slowly still counts as a sign of life before it is complete.
#[derive(Debug)]
pub(crate) struct Progress<R, F> {
    pub(crate) inner: R,
    pub(crate) on_progress: F,
}

impl<R: Read, F: FnMut()> Read for Progress<R, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 {
            (self.on_progress)();
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out data in fixed small chunks, then reports a timeout once.
    struct Chunky {
        data: Vec<u8>,
        pos: usize,
        chunk: usize,
        timeout_at: Option<usize>,
    }

    impl Read for Chunky {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.timeout_at == Some(self.pos) {
                self.timeout_at = None;
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timeout"));
            }
            let n = self.chunk.min(buf.len()).min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    #[test]
    fn frame_reader_survives_partial_reads_and_timeouts() {
        let mut data = Vec::new();
        write_frame(&mut data, b"hello").unwrap();
        write_frame(&mut data, &[]).unwrap();
        write_frame(&mut data, &[7u8; 100_000]).unwrap();
        let mut src = Chunky {
            data,
            pos: 0,
            chunk: 3,
            timeout_at: Some(6),
        };
        let mut r = FrameReader::new(MAX_FRAME);
        let err = r.read_frame(&mut src).unwrap_err();
        assert!(err.is_timeout());
        assert_eq!(r.read_frame(&mut src).unwrap(), b"hello");
        assert_eq!(r.read_frame(&mut src).unwrap(), b"");
        assert_eq!(r.read_frame(&mut src).unwrap(), vec![7u8; 100_000]);
        assert!(matches!(r.read_frame(&mut src), Err(FrameError::Eof)));
    }

    #[test]
    fn frame_reader_rejects_oversized_and_truncated_frames() {
        let mut data = Vec::new();
        write_frame(&mut data, &[0u8; 100]).unwrap();
        let mut r = FrameReader::new(99);
        let mut src = Chunky {
            data: data.clone(),
            pos: 0,
            chunk: 1000,
            timeout_at: None,
        };
        assert!(matches!(
            r.read_frame(&mut src),
            Err(FrameError::TooLarge { len: 100, max: 99 })
        ));
        data.truncate(50);
        let mut r = FrameReader::new(MAX_FRAME);
        let mut src = Chunky {
            data,
            pos: 0,
            chunk: 1000,
            timeout_at: None,
        };
        assert!(matches!(r.read_frame(&mut src), Err(FrameError::Truncated)));
    }
}
