//! Small helpers over ordered JSON values (`minijinja::Value` maps keep
//! insertion order here).

use indexmap::IndexMap;
use minijinja::Value;
use minijinja::value::ValueKind;

use crate::error::RequestError;

/// An ordered map under construction.
pub type Map = IndexMap<Value, Value>;

/// A map value from `map`.
pub fn object(map: Map) -> Value {
    Value::from_object(map)
}

/// The entries of a map value, in order (empty for non-maps).
pub fn entries(v: &Value) -> Map {
    let mut out = Map::new();
    if v.kind() == ValueKind::Map
        && let Ok(keys) = v.try_iter()
    {
        for k in keys {
            let item = v.get_item(&k).unwrap_or_default();
            out.insert(k, item);
        }
    }
    out
}

/// `v[key]` when `v` is a map holding `key` (a JSON `null` is returned as
/// `Some(none)`).
pub fn get(v: &Value, key: &str) -> Option<Value> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    // By name: maps of up to 12 keys (every message) are scanned, not hashed.
    let item = v.get_attr(key).ok()?;
    if item.is_undefined() {
        None
    } else {
        Some(item)
    }
}

/// `v[key]` unless absent or `null`.
pub fn get_some(v: &Value, key: &str) -> Option<Value> {
    get(v, key).filter(|x| !x.is_none())
}

/// The items of a list value.
pub fn items(v: &Value) -> Option<Vec<Value>> {
    if v.kind() != ValueKind::Seq {
        return None;
    }
    v.try_iter().ok().map(Iterator::collect)
}

/// `v[key]` as a string, or a validation error naming `param`.
pub fn req_str(v: &Value, key: &str, param: &str) -> Result<String, RequestError> {
    match get(v, key) {
        Some(s) if s.kind() == ValueKind::String => Ok(s.as_str().unwrap_or_default().to_owned()),
        Some(_) => Err(RequestError::invalid(
            param,
            format!("{param}: Input should be a valid string"),
        )),
        None => Err(RequestError::invalid(
            param,
            format!("{param}: Field required"),
        )),
    }
}

/// `v[key]` as an optional string (absent or `null` is `None`).
pub fn opt_str(v: &Value, key: &str, param: &str) -> Result<Option<String>, RequestError> {
    match get_some(v, key) {
        None => Ok(None),
        Some(s) if s.kind() == ValueKind::String => {
            Ok(Some(s.as_str().unwrap_or_default().to_owned()))
        }
        Some(_) => Err(RequestError::invalid(
            param,
            format!("{param}: Input should be a valid string"),
        )),
    }
}

/// `v[key]` as an optional boolean.
pub fn opt_bool(v: &Value, key: &str, param: &str) -> Result<Option<bool>, RequestError> {
    match get_some(v, key) {
        None => Ok(None),
        Some(b) if b.kind() == ValueKind::Bool => Ok(Some(b.is_true())),
        Some(_) => Err(RequestError::invalid(
            param,
            format!("{param}: Input should be a valid boolean"),
        )),
    }
}

/// Whether `v` is a string.
pub fn is_str(v: &Value) -> bool {
    v.kind() == ValueKind::String
}

/// Whether `v` is a map.
pub fn is_map(v: &Value) -> bool {
    v.kind() == ValueKind::Map
}

/// A string value.
pub fn s(text: &str) -> Value {
    Value::from(text)
}
