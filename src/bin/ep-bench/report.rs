//! The run's results as JSON (`--json FILE`), beside the Markdown tables:
//! what bench/plot.py reads. Schema `ep-bench/1`:
//!
//! ```text
//! { "schema": "ep-bench/1", "date", "device", "ranks", "backend", "timing",
//!   "nccl", "command",
//!   "tables": [ { "title", "mode": "normal" | "ll", "hidden", "topk",
//!                 "experts", "iterations", "sms" (normal mode, else null),
//!                 "rows": [ { "op", "tokens", "sms", "median_us", "p10_us",
//!                             "p90_us", "gbps", "nccl_us", "floor_us" } ] } ] }
//! ```
//!
//! Numbers the table leaves out (no GB/s, no NCCL, no SM count, no copy
//! floor) are null; runs recorded before the copy floor have no "floor_us".

use std::fmt::Write;

/// A JSON value, written by [`Value::write`]. Enough for this report.
#[derive(Clone)]
pub enum Value {
    Null,
    Num(f64),
    Str(String),
    Arr(Vec<Value>),
    Obj(Vec<(&'static str, Value)>),
}

impl Value {
    /// A number, or null for `None` (or, as every number, when not finite).
    pub fn opt_num(v: Option<impl Into<f64>>) -> Value {
        v.map_or(Value::Null, |x| Value::Num(x.into()))
    }

    pub fn write(&self, out: &mut String, indent: usize) {
        let pad = "  ".repeat(indent + 1);
        match self {
            Value::Null => out.push_str("null"),
            Value::Num(x) if !x.is_finite() => out.push_str("null"),
            Value::Num(x) if x.fract() == 0.0 && x.abs() < 1e15 => {
                let _ = write!(out, "{}", *x as i64);
            }
            Value::Num(x) => {
                let _ = write!(out, "{x}");
            }
            Value::Str(s) => write_str(out, s),
            Value::Arr(items) if items.is_empty() => out.push_str("[]"),
            Value::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    out.push_str(&pad);
                    item.write(out, indent + 1);
                }
                let _ = write!(out, "\n{}]", "  ".repeat(indent));
            }
            Value::Obj(fields) => {
                out.push('{');
                for (i, (key, value)) in fields.iter().enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    out.push_str(&pad);
                    write_str(out, key);
                    out.push_str(": ");
                    value.write(out, indent + 1);
                }
                let _ = write!(out, "\n{}}}", "  ".repeat(indent));
            }
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One table: its description and rows.
pub struct Table {
    pub title: String,
    pub mode: &'static str,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub iterations: usize,
    pub sms: Option<i32>,
    pub rows: Vec<Value>,
}

/// The whole run.
pub struct Report {
    /// The run's fields (date, device, ...), in order.
    pub header: Vec<(&'static str, Value)>,
    pub tables: Vec<Table>,
}

impl Report {
    pub fn to_json(&self) -> String {
        let mut fields = vec![("schema", Value::Str("ep-bench/1".into()))];
        fields.extend(self.header.iter().cloned());
        let tables = self
            .tables
            .iter()
            .map(|t| {
                Value::Obj(vec![
                    ("title", Value::Str(t.title.clone())),
                    ("mode", Value::Str(t.mode.into())),
                    ("hidden", Value::Num(t.hidden as f64)),
                    ("topk", Value::Num(t.topk as f64)),
                    ("experts", Value::Num(t.experts as f64)),
                    ("iterations", Value::Num(t.iterations as f64)),
                    ("sms", Value::opt_num(t.sms)),
                    ("rows", Value::Arr(t.rows.clone())),
                ])
            })
            .collect();
        fields.push(("tables", Value::Arr(tables)));
        let mut out = String::new();
        Value::Obj(fields).write(&mut out, 0);
        out.push('\n');
        out
    }
}
