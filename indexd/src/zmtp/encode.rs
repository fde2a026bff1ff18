//! What indexd writes: its greeting, commands, messages and subscriptions.
#![deny(clippy::indexing_slicing)]

use bytes::{BufMut, Bytes, BytesMut};

use super::codec::{
    FLAG_COMMAND, FLAG_LONG, FLAG_MORE, GREETING_LEN, MECHANISM_NULL, Role, SIGNATURE_FIRST,
    SIGNATURE_LAST, VERSION,
};

/// Our greeting: ZMTP 3.1, NULL, not as-server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    let fields = [
        (0, SIGNATURE_FIRST),
        (9, SIGNATURE_LAST),
        (10, VERSION.0),
        (11, VERSION.1),
    ];
    for (offset, value) in fields {
        if let Some(b) = g.get_mut(offset) {
            *b = value;
        }
    }
    if let Some(mechanism) = g.get_mut(12..32) {
        mechanism.copy_from_slice(MECHANISM_NULL);
    }
    g
}

/// Appends one frame (short or long form as its length needs).
pub fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    match u8::try_from(body.len()) {
        Ok(short) => {
            out.reserve(2 + body.len());
            out.put_u8(flags & !FLAG_LONG);
            out.put_u8(short);
        }
        Err(_) => {
            out.reserve(9 + body.len());
            out.put_u8(flags | FLAG_LONG);
            out.put_u64(u64::try_from(body.len()).unwrap_or(u64::MAX));
        }
    }
    out.put_slice(body);
}

/// Appends a message: every frame but the last has MORE set.
pub fn put_message(out: &mut BytesMut, frames: &[Bytes]) {
    let last = frames.len().saturating_sub(1);
    for (i, f) in frames.iter().enumerate() {
        put_frame(out, if i < last { FLAG_MORE } else { 0 }, f);
    }
}

/// Appends a command frame. Names are ours: at most 255 bytes.
pub fn put_command(out: &mut BytesMut, name: &str, data: &[u8]) {
    let name = name.as_bytes();
    let name = name.get(..255).unwrap_or(name);
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    put_frame(out, FLAG_COMMAND, &body);
}

/// Appends READY with `Socket-Type` (and an empty `Identity` for DEALER).
pub fn put_ready(out: &mut BytesMut, role: Role) {
    let mut meta = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        meta.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        meta.extend_from_slice(name.as_bytes());
        meta.extend_from_slice(&u32::try_from(value.len()).unwrap_or(0).to_be_bytes());
        meta.extend_from_slice(value);
    };
    prop("Socket-Type", role.socket_type().as_bytes());
    if role == Role::Dealer {
        prop("Identity", b"");
    }
    put_command(out, "READY", &meta);
}

/// Appends ERROR with a reason (at most 255 bytes).
pub fn put_error(out: &mut BytesMut, reason: &str) {
    let reason = reason.as_bytes();
    let reason = reason.get(..255).unwrap_or(reason);
    let mut data = vec![u8::try_from(reason.len()).unwrap_or(u8::MAX)];
    data.extend_from_slice(reason);
    put_command(out, "ERROR", &data);
}

/// Appends PING.
pub fn put_ping(out: &mut BytesMut, ttl: u16, context: &[u8]) {
    let mut data = ttl.to_be_bytes().to_vec();
    data.extend_from_slice(context);
    put_command(out, "PING", &data);
}

/// Appends PONG echoing a PING's context.
pub fn put_pong(out: &mut BytesMut, context: &[u8]) {
    put_command(out, "PONG", context);
}

/// Appends a subscription in the message form (`0x01` + topic; an empty
/// topic subscribes to everything), which libzmq 4.x and ZMTP 3.0 peers
/// accept alike.
pub fn put_subscribe(out: &mut BytesMut, topic: &[u8]) {
    let mut body = Vec::with_capacity(1 + topic.len());
    body.push(1);
    body.extend_from_slice(topic);
    put_frame(out, 0, &body);
}
