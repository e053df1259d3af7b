//! docs/BENCHMARKS.md: one section per suite, replaced in place between markers so suites can
//! be re-run one at a time.

use std::path::Path;

use anyhow::Context;

pub struct Row {
    pub what: String,
    pub direct: String,
    pub gateway: String,
    pub ratio: Option<f64>,
    pub target: String,
}

impl Row {
    /// A throughput row: both medians and their ratio, gateway/direct.
    pub fn ratio(what: impl Into<String>, direct: f64, gateway: f64, target: &str) -> Self {
        Self {
            what: what.into(),
            direct: format!("{direct:.0}"),
            gateway: format!("{gateway:.0}"),
            ratio: Some(gateway / direct),
            target: target.to_owned(),
        }
    }

    /// A latency row: the gateway's cell also says how much the gateway added.
    pub fn added(what: impl Into<String>, direct: f64, gateway: f64, target: &str) -> Self {
        Self {
            what: what.into(),
            direct: format!("{direct:.0}"),
            gateway: format!("{gateway:.0} ({:+.0})", gateway - direct),
            ratio: None,
            target: target.to_owned(),
        }
    }
}

/// A table of its own columns, for suites that compare more than two paths.
pub struct Table {
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    fn render(&self, s: &mut String) {
        s.push_str(&format!("\n| {} |\n", self.headers.join(" | ")));
        // The first column is text, the others figures: right-aligned.
        let align: Vec<&str> = (0..self.headers.len())
            .map(|i| if i == 0 { "---" } else { "---:" })
            .collect();
        s.push_str(&format!("|{}|\n", align.join("|")));
        for row in &self.rows {
            s.push_str(&format!("| {} |\n", row.join(" | ")));
        }
    }
}

pub struct Section {
    pub name: String,
    pub title: String,
    pub setup: Vec<String>,
    pub headers: [String; 2],
    /// The direct-against-gateway table; not rendered when empty.
    pub rows: Vec<Row>,
    /// Further tables, after it.
    pub tables: Vec<Table>,
    pub notes: Vec<String>,
}

impl Section {
    pub fn render(&self, command: &str) -> String {
        let mut s = format!("## {}\n\nCommand: `{command}`\n\n", self.title);
        for line in &self.setup {
            s.push_str(&format!("- {line}\n"));
        }
        if !self.rows.is_empty() {
            s.push_str(&format!(
                "\n| what | {} | {} | ratio | target |\n|---|---|---|---|---|\n",
                self.headers[0], self.headers[1]
            ));
        }
        for r in &self.rows {
            let ratio = r.ratio.map_or("-".into(), |x| format!("{x:.2}x"));
            s.push_str(&format!(
                "| {} | {} | {} | {ratio} | {} |\n",
                r.what, r.direct, r.gateway, r.target
            ));
        }
        for table in &self.tables {
            table.render(&mut s);
        }
        if !self.notes.is_empty() {
            s.push('\n');
            for n in &self.notes {
                s.push_str(&format!("{n}\n"));
            }
        }
        s
    }
}

pub fn write(path: &Path, name: &str, body: &str) -> anyhow::Result<()> {
    let begin = format!("<!-- suite:{name} begin -->");
    let end = format!("<!-- suite:{name} end -->");
    let old = std::fs::read_to_string(path).unwrap_or_else(|_| {
        "# Benchmarks\n\nFigures from `fencegate-bench` (bench/). Direct and gateway runs are interleaved; \
         each figure is the median of the repetitions. Nothing here is asserted by a test.\n"
            .to_owned()
    });
    let block = format!("{begin}\n{body}{end}\n");
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(b), Some(e)) if b < e => format!(
            "{}{block}{}",
            &old[..b],
            &old[e + end.len()..].trim_start_matches('\n')
        ),
        _ => format!("{}\n{block}", old.trim_end()),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
