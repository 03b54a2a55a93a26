//! ep-bench on the host backend: the benchmark binary's arguments, both
//! modes, the token sweeps and its own result checks run in CI, where there
//! is no GPU (its numbers mean nothing there).

mod common;

use common::tools::run;
use std::process::Command;

fn run_bench(args: &[&str]) -> String {
    run(
        Command::new(env!("CARGO_BIN_EXE_ep-bench"))
            .args(["--backend", "host", "--ranks", "2", "--hidden", "512"])
            .args(["--iters", "2", "--warmup", "1"])
            .args(args),
        &format!("ep-bench {args:?}"),
    )
}

/// The table rows of `op` (the first column), one per token count.
fn rows<'a>(table: &'a str, op: &str) -> Vec<&'a str> {
    table
        .lines()
        .filter(|l| l.starts_with(&format!("| {op} |")))
        .collect()
}

#[test]
fn both_modes_run_and_print_their_tables() {
    let out = run_bench(&["--mode", "all", "--tokens", "16"]);
    assert_eq!(rows(&out, "dispatch BF16").len(), 1, "{out}");
    assert_eq!(rows(&out, "combine BF16 source-order").len(), 1, "{out}");
    assert_eq!(
        rows(&out, "LL dispatch FP8 (weights at dispatch)").len(),
        1,
        "{out}"
    );
    assert_eq!(
        rows(&out, "LL combine BF16 (weights at combine)").len(),
        1,
        "{out}"
    );
}

#[test]
fn token_sweeps_give_a_row_per_count() {
    let out = run_bench(&["--mode", "ll", "--sweep-tokens", "1,8,33"]);
    let dispatch = rows(&out, "LL dispatch FP8 (weights at dispatch)");
    assert_eq!(dispatch.len(), 3, "{out}");
    for (row, tokens) in dispatch.iter().zip([1, 8, 33]) {
        assert!(row.contains(&format!("| {tokens} |")), "{row}");
    }
    let out = run_bench(&["--mode", "normal", "--sweep-tokens", "1,5"]);
    assert_eq!(rows(&out, "dispatch FP8").len(), 2, "{out}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .args(["--backend", "host", "--mode", "sideways"])
        .output()
        .expect("ep-bench runs");
    assert_eq!(out.status.code(), Some(2));
}

/// `--mode traffic`: per-rank bytes over the network and NVLink from the
/// hierarchical plans, next to the single-node paths; the hierarchy sends
/// fewer bytes over the network, and with one node none.
#[test]
fn traffic_mode_counts_network_and_nvlink_bytes() {
    let traffic = |rpn: &str| {
        run(
            Command::new(env!("CARGO_BIN_EXE_ep-bench"))
                .args(["--mode", "traffic", "--ranks", "4", "--ranks-per-node", rpn])
                .args(["--tokens", "64", "--hidden", "512", "--topk", "4"])
                .args(["--experts", "16"]),
            &format!("ep-bench --mode traffic --ranks-per-node {rpn}"),
        )
    };
    let out = traffic("2");
    assert!(out.contains("4 ranks in 2 node(s) of 2"), "{out}");
    for rank in 0..4 {
        assert_eq!(rows(&out, &rank.to_string()).len(), 1, "{out}");
    }
    let all = rows(&out, "all")[0];
    let cells: Vec<f64> = all
        .split('|')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    assert_eq!(cells.len(), 4, "{all}");
    assert!(cells[0] > 0.0 && cells[0] < cells[1], "{all}");
    let ratio = out
        .lines()
        .find_map(|l| l.strip_prefix("Network bytes: hierarchical / single-node paths = "))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .expect("the ratio line");
    assert!(ratio > 0.0 && ratio < 1.0, "{out}");
    let one_node = traffic("4");
    assert!(
        one_node.contains("Network bytes: none (one node)."),
        "{one_node}"
    );
}

#[test]
fn json_holds_every_table_row() {
    let path = std::env::temp_dir().join(format!("ep-bench-{}.json", std::process::id()));
    let out = run_bench(
        &["--mode", "all", "--sweep-tokens", "3,9", "--json"]
            .iter()
            .copied()
            .chain([path.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    let table_rows = out
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| op |") && !l.starts_with("| --- |"))
        .filter(|l| !l.contains("n/a (host backend)"))
        .count();
    // Python reads it (bench/plot.py): load it there and count.
    let check = run(
        Command::new("python3")
            .args([
                "-c",
                "import json, sys; d = json.load(open(sys.argv[1])); \
                 assert d['schema'] == 'ep-bench/1' and d['ranks'] == 2 and d['backend'] == 'host'; \
                 assert [t['mode'] for t in d['tables']] == ['normal', 'll']; \
                 rows = [r for t in d['tables'] for r in t['rows']]; \
                 assert all(r['median_us'] > 0 and r['tokens'] in (3, 9) for r in rows); \
                 print(len(rows))",
            ])
            .arg(&path),
        "python3 reading the JSON",
    );
    let _ = std::fs::remove_file(&path);
    let rows: usize = check.trim().parse().unwrap();
    assert_eq!(rows, table_rows, "one JSON row per table row:\n{out}");
}
