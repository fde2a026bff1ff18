//! The proxy-wasm host ABI, called directly.
//!
//! The SDK's `hostcalls` turn every status they do not expect into a panic,
//! and a panic traps the VM: Envoy then fails every later request on that
//! worker. Envoy answers `BadArgument` where the SDK expects `Ok` or
//! `NotFound`, for example when the headers of a failed callout (reset,
//! timeout) are read. So the filter reads and writes through these wrappers,
//! which return every status as a value. Only the two dispatch calls stay
//! with the SDK, because its dispatcher must register their tokens to route
//! the answers back (Envoy answers those with `Ok`, `BadArgument`,
//! `ParseFailure` or `InternalFailure`, all of which the SDK returns as
//! errors).
//!
//! The byte formats (header pairs, property paths) are plain functions,
//! tested natively; the host calls themselves exist only in wasm.

use std::fmt;

/// A proxy-wasm status other than `Ok`, as the host returned it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    /// The key or value does not exist.
    pub const NOT_FOUND: Self = Self(1);
    /// The host refused an argument (or has no such map right now).
    pub const BAD_ARGUMENT: Self = Self(2);
    /// A compare-and-swap lost.
    pub const CAS_MISMATCH: Self = Self(8);

    fn name(self) -> &'static str {
        match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            6 => "InvalidMemoryAccess",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "Unknown",
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

/// Decodes a serialized header map: a little-endian `u32` count, then a
/// `(u32 name length, u32 value length)` pair per entry, then each name and
/// value followed by a NUL. `None` if the bytes do not hold what they claim.
pub fn decode_pairs(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |at: usize| -> Option<usize> {
        let raw: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(raw)).ok()
    };
    let count = u32_at(0)?;
    let mut data = count.checked_mul(8)?.checked_add(4)?;
    if data > bytes.len() {
        return None;
    }
    let mut pairs = Vec::with_capacity(count);
    for n in 0..count {
        let sizes = n.checked_mul(8)?.checked_add(4)?;
        let (name_len, value_len) = (u32_at(sizes)?, u32_at(sizes.checked_add(4)?)?);
        let (name, after) = nul_terminated(bytes, data, name_len)?;
        let (value, after) = nul_terminated(bytes, after, value_len)?;
        data = after;
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Some(pairs)
}

/// `len` bytes at `at`, then a NUL; the bytes and the position after the NUL.
fn nul_terminated(bytes: &[u8], at: usize, len: usize) -> Option<(&[u8], usize)> {
    let end = at.checked_add(len)?;
    let text = bytes.get(at..end)?;
    (bytes.get(end) == Some(&0)).then_some((text, end.checked_add(1)?))
}

/// Encodes a property path: each segment followed by a NUL.
pub fn encode_path(path: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.iter().map(|s| s.len().saturating_add(1)).sum());
    for segment in path {
        out.extend_from_slice(segment.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(target_arch = "wasm32")]
pub use calls::*;

#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)]
mod calls {
    //! The host functions and safe wrappers around them.
    //!
    //! Safety, for every call below: the pointers passed are to live Rust
    //! slices or locals for the duration of the call; a buffer the host
    //! returns was allocated by the SDK's `proxy_on_memory_allocate` as a
    //! `Vec<u8>` of exactly `size` bytes, so it is taken back with
    //! `Vec::from_raw_parts(ptr, size, size)`, as the SDK itself does.
    //! Statuses are read as `u32`, never as a Rust enum, so a value the SDK
    //! does not know cannot be undefined behaviour.

    use std::ptr::{null, null_mut};

    use super::{Status, decode_pairs, encode_path};

    #[link(wasm_import_module = "env")]
    unsafe extern "C" {
        fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
        fn proxy_get_log_level(return_level: *mut u32) -> u32;
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        fn proxy_get_buffer_bytes(
            buffer_type: u32,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        fn proxy_get_header_map_pairs(
            map_type: u32,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> u32;
        fn proxy_get_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_remove_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
        ) -> u32;
        fn proxy_continue_stream(stream_type: u32) -> u32;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
        fn proxy_define_metric(
            metric_type: u32,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    }

    /// Header maps (proxy-wasm `MapType`).
    #[derive(Clone, Copy, Debug)]
    #[repr(u32)]
    pub enum Map {
        RequestHeaders = 0,
        ResponseHeaders = 2,
        CallResponseHeaders = 6,
    }

    /// Buffers (proxy-wasm `BufferType`).
    #[derive(Clone, Copy, Debug)]
    #[repr(u32)]
    pub enum Buffer {
        RequestBody = 0,
        ResponseBody = 1,
        CallResponseBody = 4,
        GrpcReceive = 5,
        PluginConfiguration = 7,
    }

    /// Streams (proxy-wasm `StreamType`).
    #[derive(Clone, Copy, Debug)]
    #[repr(u32)]
    pub enum Stream {
        Request = 0,
        Response = 1,
    }

    /// Metric kinds (proxy-wasm `MetricType`).
    #[derive(Clone, Copy, Debug)]
    #[repr(u32)]
    pub enum MetricKind {
        Counter = 0,
        Gauge = 1,
        Histogram = 2,
    }

    fn ok(status: u32) -> Result<(), Status> {
        match status {
            0 => Ok(()),
            s => Err(Status(s)),
        }
    }

    /// Takes back a host-returned buffer (`None` for a null pointer).
    fn owned(data: *mut u8, size: usize) -> Option<Vec<u8>> {
        if data.is_null() {
            return None;
        }
        // SAFETY: see the module doc: the host allocated `size` bytes at
        // `data` through the SDK's allocator, and hands them over to us.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }

    /// Logs a message; a failing log call is ignored.
    pub fn log(level: u32, message: &str) {
        // SAFETY: see the module doc.
        let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
    }

    /// Envoy's log level for this plugin (proxy-wasm numbering, 0 = trace).
    pub fn log_level() -> Result<u32, Status> {
        let mut level = 0u32;
        // SAFETY: see the module doc.
        ok(unsafe { proxy_get_log_level(&mut level) })?;
        Ok(level)
    }

    /// Wall-clock nanoseconds since the Unix epoch.
    pub fn now_ns() -> Result<u64, Status> {
        let mut ns = 0u64;
        // SAFETY: see the module doc.
        ok(unsafe { proxy_get_current_time_nanoseconds(&mut ns) })?;
        Ok(ns)
    }

    /// Bytes `start..start + max` of a buffer (`None` if there is none).
    pub fn buffer(which: Buffer, start: usize, max: usize) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: see the module doc.
        let status =
            unsafe { proxy_get_buffer_bytes(which as u32, start, max, &mut data, &mut size) };
        match status {
            0 => Ok(owned(data, size)),
            1 => Ok(None),
            s => Err(Status(s)),
        }
    }

    /// Every header of a map, names and raw values.
    pub fn header_pairs(map: Map) -> Result<Vec<(String, Vec<u8>)>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: see the module doc.
        ok(unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) })?;
        match owned(data, size) {
            None => Ok(Vec::new()),
            Some(bytes) => decode_pairs(&bytes).ok_or(Status::BAD_ARGUMENT),
        }
    }

    /// One header's raw value (`None` if absent).
    pub fn header(map: Map, name: &str) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: see the module doc.
        let status = unsafe {
            proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size)
        };
        match status {
            0 => Ok(Some(owned(data, size).unwrap_or_default())),
            1 => Ok(None),
            s => Err(Status(s)),
        }
    }

    /// Sets (`Some`) or removes (`None`) a header.
    pub fn set_header(map: Map, name: &str, value: Option<&str>) -> Result<(), Status> {
        // SAFETY: see the module doc.
        ok(unsafe {
            match value {
                Some(v) => proxy_replace_header_map_value(
                    map as u32,
                    name.as_ptr(),
                    name.len(),
                    v.as_ptr(),
                    v.len(),
                ),
                None => proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()),
            }
        })
    }

    /// Resumes a paused stream.
    pub fn resume(stream: Stream) -> Result<(), Status> {
        // SAFETY: see the module doc.
        ok(unsafe { proxy_continue_stream(stream as u32) })
    }

    /// A stream or host property (`None` if absent).
    pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
        let path = encode_path(path);
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: see the module doc.
        let status = unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) };
        match status {
            0 => Ok(owned(data, size)),
            1 => Ok(None),
            s => Err(Status(s)),
        }
    }

    /// A shared-data value and its CAS token (`(None, None)` if never set).
    pub fn shared(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
        let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
        // SAFETY: see the module doc.
        let status = unsafe {
            proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas)
        };
        match status {
            0 => Ok((owned(data, size), (cas != 0).then_some(cas))),
            1 => Ok((None, None)),
            s => Err(Status(s)),
        }
    }

    /// Writes a shared-data value if its CAS token still equals `cas`
    /// (`None`: unconditionally).
    pub fn set_shared(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        let data = if value.is_empty() {
            null()
        } else {
            value.as_ptr()
        };
        // SAFETY: see the module doc.
        ok(unsafe {
            proxy_set_shared_data(key.as_ptr(), key.len(), data, value.len(), cas.unwrap_or(0))
        })
    }

    /// Defines a metric; its id.
    pub fn define_metric(kind: MetricKind, name: &str) -> Result<u32, Status> {
        let mut id = 0u32;
        // SAFETY: see the module doc.
        ok(unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    /// Adds to a counter.
    pub fn increment_metric(id: u32, by: i64) -> Result<(), Status> {
        // SAFETY: see the module doc.
        ok(unsafe { proxy_increment_metric(id, by) })
    }

    /// Records a histogram sample, or sets a gauge.
    pub fn record_metric(id: u32, value: u64) -> Result<(), Status> {
        // SAFETY: see the module doc.
        ok(unsafe { proxy_record_metric(id, value) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            out.extend((k.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            out.extend(k.as_bytes());
            out.push(0);
            out.extend(*v);
            out.push(0);
        }
        out
    }

    #[test]
    fn pairs_round_trip() {
        let pairs: &[(&str, &[u8])] = &[(":status", b"200"), ("x", b""), ("bin", b"\xff\x00")];
        let decoded = decode_pairs(&encode(pairs)).unwrap();
        assert_eq!(decoded.len(), 3);
        assert_eq!(decoded[0], (":status".to_owned(), b"200".to_vec()));
        assert_eq!(decoded[2].1, b"\xff\x00");
        assert_eq!(decode_pairs(&[]), Some(Vec::new()));
    }

    #[test]
    fn truncated_or_lying_pairs_are_refused_without_panic() {
        let bytes = encode(&[("name", b"value"), ("other", b"v")]);
        for cut in 0..bytes.len() {
            if cut > 0 {
                assert_eq!(decode_pairs(&bytes[..cut]), None, "cut at {cut}");
            }
        }
        let mut huge = bytes.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_pairs(&huge), None);
        let mut long_name = bytes;
        long_name[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_pairs(&long_name), None);
    }

    #[test]
    fn paths_are_nul_separated() {
        assert_eq!(
            encode_path(&["upstream", "address"]),
            b"upstream\0address\0"
        );
    }

    #[test]
    fn statuses_print_their_names() {
        assert_eq!(format!("{:?}", Status::BAD_ARGUMENT), "BadArgument(2)");
        assert_eq!(format!("{:?}", Status(99)), "Unknown(99)");
    }
}
