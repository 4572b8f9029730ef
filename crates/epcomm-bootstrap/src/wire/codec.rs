//! The little-endian primitives message bodies are made of: [`Enc`] appends them, [`Dec`]
//! reads them back and turns every shortfall into a [`DecodeError`] naming the field.
//!
//! Integers are little-endian; `usize` travels as `u64`; `bytes` is a `u32` length then the
//! bytes; `str` is `bytes` holding UTF-8.

use super::MAGIC;

/// A malformed message body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Appends primitives to a message body; the body is the `.0` vector.
#[derive(Debug, Default)]
pub(super) struct Enc(pub(super) Vec<u8>);

impl Enc {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    pub(super) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        // Bodies never exceed MAX_FRAME (< u32::MAX), which write_frame enforces.
        self.u32(v.len().min(u32::MAX as usize) as u32);
        self.0.extend_from_slice(v);
        self
    }
    pub(super) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads primitives from a message body front to back; every read names the field it reads,
/// and [`Dec::finish`] insists the body was consumed exactly.
#[derive(Debug)]
pub(super) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Dec { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() - self.pos < n {
            return Err(DecodeError(format!(
                "message truncated while reading {what} ({n} bytes needed, {} left)",
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(super) fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn usize(&mut self, what: &str) -> Result<usize, DecodeError> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| DecodeError(format!("{what} = {v} does not fit in usize")))
    }
    pub(super) fn bytes(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub(super) fn str(&mut self, what: &str) -> Result<String, DecodeError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
    pub(super) fn magic(&mut self) -> Result<(), DecodeError> {
        if self.take(8, "magic")? != MAGIC {
            return Err(DecodeError(
                "bad magic: peer is not an epcomm bootstrap".into(),
            ));
        }
        Ok(())
    }
    pub(super) fn finish(&self, what: &str) -> Result<(), DecodeError> {
        if self.pos != self.buf.len() {
            return Err(DecodeError(format!(
                "{} trailing bytes after {what}",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}
