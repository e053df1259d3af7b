//! `-o table`: the API's JSON as aligned text for people. A list of objects becomes one row per
//! object (columns: the keys, sorted as the JSON map keeps them); an object holding such a list (`{"locks":
//! [...]}`) prints its other fields as `key: value` lines, then the list; any other object
//! prints one `key: value` line per field. Scripts keep the default, JSON.

use serde_json::Value;

/// How a client command prints the API's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// The API's JSON, one document (for scripts).
    #[default]
    Json,
    /// Aligned columns (for people).
    Table,
}

/// Renders `value` as text (see the module doc).
pub fn render(value: &Value) -> String {
    match value {
        Value::Array(rows) => rows_table(rows),
        Value::Object(fields) => {
            let list = fields
                .iter()
                .find(|(_, v)| v.as_array().is_some_and(|a| a.iter().all(Value::is_object)));
            let mut out = String::new();
            let width = fields.keys().map(|k| k.chars().count()).max().unwrap_or(0);
            for (key, field) in fields {
                if list.is_some_and(|(name, _)| name == key) {
                    continue;
                }
                out.push_str(&format!("{key:<width$}  {}\n", cell(field)));
            }
            if let Some((name, Value::Array(rows))) = list {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(&format!("{name}:\n"));
                out.push_str(&rows_table(rows));
            }
            out
        }
        other => format!("{}\n", cell(other)),
    }
}

/// One row per element; an empty list says so.
fn rows_table(rows: &[Value]) -> String {
    if rows.is_empty() {
        return "(none)\n".to_owned();
    }
    let mut columns: Vec<String> = Vec::new();
    for row in rows {
        if let Value::Object(fields) = row {
            for key in fields.keys() {
                if !columns.contains(key) {
                    columns.push(key.clone());
                }
            }
        }
    }
    if columns.is_empty() {
        return rows.iter().map(|r| format!("{}\n", cell(r))).collect();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            columns
                .iter()
                .map(|c| row.get(c).map(cell).unwrap_or_default())
                .collect()
        })
        .collect();
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain([c.chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |values: &[String]| {
        let padded: Vec<String> = values
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        format!("{}\n", padded.join("  ").trim_end())
    };
    let header: Vec<String> = columns.iter().map(|c| c.to_uppercase()).collect();
    let mut out = line(&header);
    for row in &cells {
        out.push_str(&line(row));
    }
    out
}

/// A value in one cell: strings bare, null as `-`, nested values as compact JSON.
fn cell(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_list_of_objects_is_aligned_columns() {
        let text = render(&json!([
            {"resource": "billing", "revision": 7, "holder": null},
            {"resource": "payroll:2026", "revision": 12, "extra": {"a": 1}}
        ]));
        assert_eq!(
            text,
            "HOLDER  RESOURCE      REVISION  EXTRA\n\
             -       billing       7\n\
             \x20       payroll:2026  12        {\"a\":1}\n"
        );
    }

    #[test]
    fn an_object_holding_a_list_prints_fields_then_the_list() {
        let text = render(&json!({"revision": 9, "locks": [{"resource": "b", "lease_id": "x"}]}));
        assert_eq!(
            text,
            "revision  9\n\nlocks:\nLEASE_ID  RESOURCE\nx         b\n"
        );
    }

    #[test]
    fn a_plain_object_is_key_value_lines_and_empty_lists_say_none() {
        assert_eq!(
            render(&json!({"leader_id": 2, "term": 3})),
            "leader_id  2\nterm       3\n"
        );
        assert_eq!(render(&json!({"locks": []})), "locks:\n(none)\n");
        assert_eq!(render(&json!("ok")), "ok\n");
    }
}
