//! A run's side tables: their rows as a CSV file and as a Markdown table.

use std::path::Path;

use crate::{BenchError, sample};

/// Writes `rows` to `dir/csv` and their table, `markdown(rows)`, to
/// `dir/md` (nothing when `rows` is empty).
pub fn write_table<T: serde::Serialize>(
    dir: &Path,
    csv: &str,
    md: &str,
    rows: &[T],
    markdown: fn(&[T]) -> String,
) -> Result<(), BenchError> {
    if rows.is_empty() {
        return Ok(());
    }
    sample::write_csv(&dir.join(csv), rows)?;
    let path = dir.join(md);
    std::fs::write(&path, markdown(rows)).map_err(|e| BenchError::io(&path, e))
}
