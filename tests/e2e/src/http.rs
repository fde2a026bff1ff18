//! A blocking HTTP/1.1 client for tests, on `ureq`.

use std::time::Duration;

use crate::HarnessError;

/// A response, whatever its status.
#[derive(Debug, Clone)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// Response headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body as text (lossy).
    pub body: String,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

fn collect(
    url: &str,
    result: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<Response, HarnessError> {
    let mut response = result.map_err(|e| HarnessError::Http {
        context: url.to_owned(),
        message: e.to_string(),
    })?;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = response
        .body_mut()
        .read_to_string()
        .map_err(|e| HarnessError::Http {
            context: url.to_owned(),
            message: format!("reading body: {e}"),
        })?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// `GET url` with extra headers.
pub fn get(
    url: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Response, HarnessError> {
    let mut request = agent(timeout).get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    collect(url, request.call())
}

/// `POST url` with a body and extra headers.
pub fn post(
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HarnessError> {
    let mut request = agent(timeout).post(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    collect(url, request.send(body))
}
