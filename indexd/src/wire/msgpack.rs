//! A bounded msgpack reader over one frame, on the `rmp` crate's low-level
//! decoder: every read checks bounds, no length prefix allocates by itself
//! (strings and binaries are borrowed from the frame), and unknown values are
//! skipped up to [`MAX_DEPTH`] levels deep.
#![deny(clippy::indexing_slicing)]

use rmp::Marker;
use rmp::decode::{self, NumValueReadError, ValueReadError};

use super::{DecodeError, MAX_DEPTH};
use crate::event::GroupKind;

/// The msgpack type families the decoder distinguishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

fn kind(marker: Marker) -> Kind {
    match marker {
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => Kind::Int,
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
        // 0xc1 is never used; treat it like nil, as the decoder always has.
        Marker::Null | Marker::Reserved => Kind::Nil,
        Marker::True | Marker::False => Kind::Bool,
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
        Marker::F32 | Marker::F64 => Kind::Float,
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => Kind::Ext,
    }
}

/// Reading past the frame is truncation; a marker of another family is a
/// type error for `field`.
fn value_error(field: &'static str) -> impl Fn(ValueReadError<std::io::Error>) -> DecodeError {
    move |e| match e {
        ValueReadError::TypeMismatch(_) => DecodeError::UnexpectedType(field),
        ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => {
            DecodeError::Truncated
        }
    }
}

/// A cursor over one frame. Every read checks bounds.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
}

/// Eight ids at the start of `buf` if all of them are `marker` followed by a
/// big-endian value of `W - 1` bytes (`N` = 8 × `W`), and what follows them.
fn run_of_8<const W: usize, const N: usize>(buf: &[u8], marker: u8) -> Option<([u32; 8], &[u8])> {
    let (run, rest) = buf.split_first_chunk::<N>()?;
    let mut ids = [0u32; 8];
    let mut all = true;
    for (id, item) in ids.iter_mut().zip(run.chunks_exact(W)) {
        if let Some((m, value)) = item.split_first() {
            all &= *m == marker;
            *id = value.iter().fold(0, |acc, b| acc << 8 | u32::from(*b));
        }
    }
    all.then_some((ids, rest))
}

impl<'a> Reader<'a> {
    pub(super) fn peek(&self) -> Result<Kind, DecodeError> {
        self.buf
            .first()
            .map(|m| kind(Marker::from_u8(*m)))
            .ok_or(DecodeError::Truncated)
    }

    pub(super) fn byte(&mut self) -> Result<u8, DecodeError> {
        let (first, rest) = self.buf.split_first().ok_or(DecodeError::Truncated)?;
        self.buf = rest;
        Ok(*first)
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let (head, rest) = self.buf.split_at_checked(n).ok_or(DecodeError::Truncated)?;
        self.buf = rest;
        Ok(head)
    }

    fn len(n: u32) -> Result<usize, DecodeError> {
        usize::try_from(n).map_err(|_| DecodeError::Truncated)
    }

    pub(super) fn array_len(&mut self) -> Result<usize, DecodeError> {
        Self::len(decode::read_array_len(&mut self.buf).map_err(value_error("array"))?)
    }

    pub(super) fn map_len(&mut self) -> Result<usize, DecodeError> {
        Self::len(decode::read_map_len(&mut self.buf).map_err(value_error("map"))?)
    }

    pub(super) fn str_bytes(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = decode::read_str_len(&mut self.buf).map_err(value_error(field))?;
        self.take(Self::len(len)?)
    }

    pub(super) fn bin_bytes(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = decode::read_bin_len(&mut self.buf).map_err(value_error(field))?;
        self.take(Self::len(len)?)
    }

    /// A map key: the bytes of a string key, `None` for a non-string key
    /// (which has then been skipped).
    pub(super) fn key(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        if self.peek()? == Kind::Str {
            self.str_bytes("key").map(Some)
        } else {
            self.skip(0)?;
            Ok(None)
        }
    }

    pub(super) fn nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek()? == Kind::Nil {
            self.byte()?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Any msgpack int, as the u64 with the same two's-complement bits.
    pub(super) fn int(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        let value: i128 = decode::read_int(&mut self.buf).map_err(|e| match e {
            NumValueReadError::InvalidMarkerRead(_) | NumValueReadError::InvalidDataRead(_) => {
                DecodeError::Truncated
            }
            NumValueReadError::TypeMismatch(_) | NumValueReadError::OutOfRange => {
                DecodeError::UnexpectedType(field)
            }
        })?;
        match u64::try_from(value) {
            Ok(v) => Ok(v),
            Err(_) => i64::try_from(value)
                .map(|v| v as u64)
                .map_err(|_| DecodeError::UnexpectedType(field)),
        }
    }

    /// `len` token ids. The encodings vLLM's msgpack gives ids below 2³²
    /// (positive fixint, uint 8/16/32) are read straight from the frame, any
    /// other marker through [`Reader::u32`] (which decodes the rest of the
    /// integer family and reports everything else). Token arrays are most of
    /// a `BlockStored`'s bytes: the generic integer read, and the cursor kept
    /// in `self` rather than a local, cost about twice as much per id.
    ///
    /// Ids of one width come in runs (a 32k vocabulary's are nearly all
    /// uint 16, a 128k one's uint 16 and uint 32), and one id's width decides
    /// where the next starts, so reading them one by one waits on each
    /// marker in turn. Eight ids of one width are checked and read at once
    /// ([`run_of_8`]) before the one-by-one read.
    pub(super) fn token_array(
        &mut self,
        len: usize,
        field: &'static str,
    ) -> Result<Vec<u32>, DecodeError> {
        // Each token takes at least one byte of the frame.
        let mut out = Vec::with_capacity(len.min(self.buf.len()));
        let mut buf = self.buf;
        let mut left = len;
        while left > 0 {
            if left >= 8
                && let Some((ids, rest)) =
                    run_of_8::<3, 24>(buf, 0xcd).or_else(|| run_of_8::<5, 40>(buf, 0xce))
            {
                out.extend_from_slice(&ids);
                buf = rest;
                left -= 8;
                continue;
            }
            let (value, rest) = match buf {
                [b, rest @ ..] if *b < 0x80 => (u32::from(*b), rest),
                [0xcc, b, rest @ ..] => (u32::from(*b), rest),
                [0xcd, a, b, rest @ ..] => (u32::from(u16::from_be_bytes([*a, *b])), rest),
                [0xce, a, b, c, d, rest @ ..] => (u32::from_be_bytes([*a, *b, *c, *d]), rest),
                _ => {
                    self.buf = buf;
                    let value = self.u32(field)?;
                    (value, self.buf)
                }
            };
            out.push(value);
            buf = rest;
            left -= 1;
        }
        self.buf = buf;
        Ok(out)
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        u32::try_from(self.int(field)?).map_err(|_| DecodeError::UnexpectedType(field))
    }

    pub(super) fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>, DecodeError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.u32(field).map(Some)
        }
    }

    pub(super) fn f64(&mut self, field: &'static str) -> Result<f64, DecodeError> {
        match self.buf.first().map(|m| Marker::from_u8(*m)) {
            None => Err(DecodeError::Truncated),
            Some(Marker::F32) => decode::read_f32(&mut self.buf)
                .map(f64::from)
                .map_err(value_error(field)),
            Some(Marker::F64) => decode::read_f64(&mut self.buf).map_err(value_error(field)),
            Some(m) => match kind(m) {
                Kind::Int => Ok(self.int(field)? as f64),
                Kind::Nil => {
                    self.byte()?;
                    Ok(0.0)
                }
                _ => Err(DecodeError::UnexpectedType(field)),
            },
        }
    }

    pub(super) fn opt_string(
        &mut self,
        field: &'static str,
    ) -> Result<Option<String>, DecodeError> {
        if self.nil()? {
            return Ok(None);
        }
        let bytes = self.str_bytes(field)?;
        let s = std::str::from_utf8(bytes).map_err(|_| DecodeError::Utf8(field))?;
        Ok(Some(s.to_owned()))
    }

    /// `kv_cache_spec_kind`: nil, or a label (an unknown one is kept, cut
    /// to [`GroupKind::MAX_LABEL`] bytes).
    pub(super) fn opt_kind(&mut self) -> Result<Option<GroupKind>, DecodeError> {
        if self.nil()? {
            return Ok(None);
        }
        let bytes = self.str_bytes("kv_cache_spec_kind")?;
        let s = std::str::from_utf8(bytes).map_err(|_| DecodeError::Utf8("kv_cache_spec_kind"))?;
        Ok(Some(GroupKind::from_label(s)))
    }

    /// Skips one value of any type.
    pub(super) fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        match self.peek()? {
            Kind::Nil | Kind::Bool => self.byte().map(|_| ()),
            Kind::Int => self.int("skipped").map(|_| ()),
            Kind::Float => self.f64("skipped").map(|_| ()),
            Kind::Str => self.str_bytes("skipped").map(|_| ()),
            Kind::Bin => self.bin_bytes("skipped").map(|_| ()),
            Kind::Array => {
                let len = self.array_len()?;
                self.skip_n(len, depth)
            }
            Kind::Map => {
                let len = self.map_len()?;
                self.skip_n(len.saturating_mul(2), depth)
            }
            Kind::Ext => {
                let meta = decode::read_ext_meta(&mut self.buf).map_err(value_error("ext"))?;
                self.take(Self::len(meta.size)?).map(|_| ())
            }
        }
    }

    /// Skips `count` values one level below `depth`. Every value takes at
    /// least one byte, so a count larger than the frame fails as truncation.
    pub(super) fn skip_n(&mut self, count: usize, depth: usize) -> Result<(), DecodeError> {
        for _ in 0..count {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}
