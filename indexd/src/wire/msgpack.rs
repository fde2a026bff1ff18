//! A bounded msgpack reader over one frame: every read checks bounds, no
//! length prefix allocates by itself, unknown values are skipped up to
//! [`MAX_DEPTH`] levels deep.
#![deny(clippy::indexing_slicing)]

use super::{DecodeError, MAX_DEPTH};

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

pub(super) fn kind(marker: u8) -> Kind {
    match marker {
        0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
        0x80..=0x8f | 0xde | 0xdf => Kind::Map,
        0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
        0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
        0xc0 | 0xc1 => Kind::Nil,
        0xc2 | 0xc3 => Kind::Bool,
        0xc4..=0xc6 => Kind::Bin,
        0xca | 0xcb => Kind::Float,
        0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
    }
}

/// A cursor over one frame. Every read checks bounds.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn peek(&self) -> Result<Kind, DecodeError> {
        self.buf
            .first()
            .map(|m| kind(*m))
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

    pub(super) fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N)?;
        bytes.try_into().map_err(|_| DecodeError::Truncated)
    }

    pub(super) fn len_n(&mut self, n: usize) -> Result<usize, DecodeError> {
        Ok(match n {
            1 => usize::from(self.byte()?),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => usize::try_from(u32::from_be_bytes(self.be()?))
                .map_err(|_| DecodeError::Truncated)?,
        })
    }

    pub(super) fn array_len(&mut self) -> Result<usize, DecodeError> {
        match self.byte()? {
            m @ 0x90..=0x9f => Ok(usize::from(m & 0x0f)),
            0xdc => self.len_n(2),
            0xdd => self.len_n(4),
            _ => Err(DecodeError::UnexpectedType("array")),
        }
    }

    pub(super) fn map_len(&mut self) -> Result<usize, DecodeError> {
        match self.byte()? {
            m @ 0x80..=0x8f => Ok(usize::from(m & 0x0f)),
            0xde => self.len_n(2),
            0xdf => self.len_n(4),
            _ => Err(DecodeError::UnexpectedType("map")),
        }
    }

    pub(super) fn str_bytes(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len_n(1)?,
            0xda => self.len_n(2)?,
            0xdb => self.len_n(4)?,
            _ => return Err(DecodeError::UnexpectedType(field)),
        };
        self.take(len)
    }

    pub(super) fn bin_bytes(&mut self, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = match self.byte()? {
            0xc4 => self.len_n(1)?,
            0xc5 => self.len_n(2)?,
            0xc6 => self.len_n(4)?,
            _ => return Err(DecodeError::UnexpectedType(field)),
        };
        self.take(len)
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
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => u64::from(m),
            0xe0..=0xff => i64::from(i8::from_be_bytes([m])) as u64,
            0xcc => u64::from(self.byte()?),
            0xcd => u64::from(u16::from_be_bytes(self.be()?)),
            0xce => u64::from(u32::from_be_bytes(self.be()?)),
            0xcf => u64::from_be_bytes(self.be()?),
            0xd0 => i64::from(i8::from_be_bytes(self.be()?)) as u64,
            0xd1 => i64::from(i16::from_be_bytes(self.be()?)) as u64,
            0xd2 => i64::from(i32::from_be_bytes(self.be()?)) as u64,
            0xd3 => i64::from_be_bytes(self.be()?) as u64,
            _ => return Err(DecodeError::UnexpectedType(field)),
        })
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
        match self.peek()? {
            Kind::Float => match self.byte()? {
                0xca => Ok(f64::from(f32::from_be_bytes(self.be()?))),
                _ => Ok(f64::from_be_bytes(self.be()?)),
            },
            #[allow(clippy::cast_precision_loss)]
            Kind::Int => Ok(self.int(field)? as f64),
            Kind::Nil => {
                self.byte()?;
                Ok(0.0)
            }
            _ => Err(DecodeError::UnexpectedType(field)),
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

    /// Skips one value of any type.
    pub(super) fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let m = self.byte()?;
        let n = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => 0,
            0x80..=0x8f => return self.skip_n(2 * usize::from(m & 0x0f), depth),
            0x90..=0x9f => return self.skip_n(usize::from(m & 0x0f), depth),
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xc4 | 0xd9 => self.len_n(1)?,
            0xc5 | 0xda => self.len_n(2)?,
            0xc6 | 0xdb => self.len_n(4)?,
            0xc7 => self.len_n(1)? + 1,
            0xc8 => self.len_n(2)? + 1,
            0xc9 => self.len_n(4)? + 1,
            0xca => 4,
            0xcb => 8,
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xce | 0xd2 => 4,
            0xcf | 0xd3 => 8,
            0xd4 => 2,
            0xd5 => 3,
            0xd6 => 5,
            0xd7 => 9,
            0xd8 => 17,
            0xdc => {
                let len = self.len_n(2)?;
                return self.skip_n(len, depth);
            }
            0xdd => {
                let len = self.len_n(4)?;
                return self.skip_n(len, depth);
            }
            0xde => {
                let len = self.len_n(2)?;
                return self.skip_n(2 * len, depth);
            }
            0xdf => {
                let len = self.len_n(4)?;
                return self.skip_n(len.saturating_mul(2), depth);
            }
        };
        self.take(n).map(|_| ())
    }

    pub(super) fn skip_n(&mut self, count: usize, depth: usize) -> Result<(), DecodeError> {
        for _ in 0..count {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}
