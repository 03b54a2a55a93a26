//! The scripts that run on the GPU machine (scripts/gpu-check.sh and
//! scripts/gpu-mega.sh, over their shared scripts/gpu-lib.sh), run here
//! against stubs: test binaries, ep-bench, the C programs, nvidia-smi and
//! python3 are small shell scripts that print their arguments and pass,
//! fail or hang. Checks the summary table, the logs, the timeouts, the
//! budget's skips and the exit status, that gpu-check.sh runs every step,
//! and that scripts/gpu-package.sh copies what the scripts use.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// An empty folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("runner-scripts")
        .join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes the executable shell script `path` running `body`.
fn shell_script(path: &Path, body: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// A stub program `path`: prints its name and arguments, then runs `body`.
fn stub(path: &Path, body: &str) {
    let name = path.file_name().unwrap().to_string_lossy();
    shell_script(path, &format!("echo \"{name} $*\"\n{body}"));
}

/// Copies scripts/`name` into `dir`.
fn copy_script(name: &str, dir: &Path) {
    fs::copy(root().join("scripts").join(name), dir.join(name)).unwrap();
}

/// Runs `bash script args` with `dir/bin` first on PATH and `OUT=dir/out`;
/// returns its exit status and its output.
fn run_script(dir: &Path, script: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap()
    );
    let output = Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .env("PATH", path)
        .env("OUT", dir.join("out"))
        .current_dir(dir)
        .output()
        .expect("run bash");
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.code().unwrap_or(-1), out)
}

/// The summary table's rows: (step, result) for each row after the
/// `step result time` header.
fn summary_rows(out: &str) -> Vec<(String, String)> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with("step "));
    assert!(lines.next().is_some(), "no summary table in:\n{out}");
    lines
        .map(|line| {
            // NAME RESULT TIME: the name may hold spaces, the others do not.
            let words: Vec<&str> = line.split_whitespace().collect();
            let [name @ .., result, _time] = words.as_slice() else {
                panic!("a summary row of fewer than 3 words: {line:?}");
            };
            (name.join(" "), result.to_string())
        })
        .collect()
}

fn rows(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(n, r)| (n.to_string(), r.to_string()))
        .collect()
}

#[test]
fn gpu_lib_steps_pass_fail_time_out_and_skip_within_the_budget() {
    let dir = scratch("lib");
    let driver = dir.join("driver.sh");
    fs::write(
        &driver,
        format!(
            "BUDGET=20\n. {lib}\n\
             step 'says hello' 0 5 echo hello\n\
             step 'fails/3' 0 5 sh -c 'exit 3'\n\
             step hangs 0 1 sleep 30\n\
             step 'clipped to the budget' 0 600 true\n\
             step 'needs more budget' 100 5 true\n\
             summary \"logs in $OUT\" 'a line of the caller'\n\
             exit \"$FAILED\"\n",
            lib = root().join("scripts/gpu-lib.sh").display()
        ),
    )
    .unwrap();
    let (status, out) = run_script(&dir, &driver, &[], &[]);
    assert_eq!(status, 1, "{out}");
    assert_eq!(
        summary_rows(&out),
        rows(&[
            ("says hello", "pass"),
            ("fails/3", "fail(3)"),
            ("hangs", "timeout"),
            ("clipped to the budget", "pass"),
            ("needs more budget", "skipped"),
        ])
    );
    assert!(out.contains("=== hangs (timeout 1s): sleep 30"), "{out}");
    let clipped = out
        .lines()
        .find(|l| l.starts_with("=== clipped to the budget (timeout "))
        .unwrap();
    let limit: u32 = clipped["=== clipped to the budget (timeout ".len()..]
        .split('s')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(limit <= 20, "{clipped}");
    assert!(out.contains("=== needs more budget: skipped ("), "{out}");
    assert!(out.contains("a line of the caller\nstep "), "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("=== summary ("))
        .unwrap();
    assert!(summary.ends_with(&format!("s of 20s; logs in {})", dir.join("out").display())));
    // A log per step, named after it.
    let log = |name: &str| fs::read_to_string(dir.join("out").join(name)).unwrap_or_default();
    assert_eq!(log("says_hello.log"), "hello\n");
    assert!(dir.join("out/fails_3.log").is_file());
    assert!(!dir.join("out/needs_more_budget.log").exists());

    // Every step passing exits 0; STEP_LOG gathers every step in one log.
    fs::write(
        &driver,
        format!(
            "BUDGET=20\n. {lib}\nSTEP_LOG=\"$OUT/all.log\"\nNAME_WIDTH=12\n\
             step first 0 5 echo one\nstep second 0 5 echo two\n\
             summary_table\nexit \"$FAILED\"\n",
            lib = root().join("scripts/gpu-lib.sh").display()
        ),
    )
    .unwrap();
    let (status, out) = run_script(&dir, &driver, &[], &[]);
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("\nfirst        pass "), "{out}");
    assert_eq!(
        log("all.log"),
        "=== first (timeout 5s): echo one\none\n=== second (timeout 5s): echo two\ntwo\n"
    );
}

/// A stand-in for the .gpu/ folder of scripts/gpu-package.sh, in `dir/g`,
/// with stubs for the machine's tools in `dir/bin`: one GPU, NCCL wheels.
fn stub_machine(dir: &Path) -> PathBuf {
    let g = dir.join("g");
    let libtest_ok = "echo 'test result: ok. 2 passed; 0 failed; 0 ignored'";
    stub(
        &g.join("tests/gpu_alpha"),
        &format!("echo 'skipped 4 ranks: too few GPUs'\n{libtest_ok}"),
    );
    stub(
        &g.join("tests/gpu_beta"),
        "echo 'test result: FAILED. 1 passed; 2 failed; 0 ignored'\nexit 101",
    );
    stub(
        &g.join("tests/gpu_normal"),
        &format!("echo \"worlds ${{EP_TEST_WORLDS:-all}}\"\n{libtest_ok}"),
    );
    stub(&g.join("tests/gpu_low_latency"), libtest_ok);
    stub(
        &g.join("ep-bench"),
        "while [ $# -gt 0 ]; do [ \"$1\" = --json ] && echo '{}' > \"$2\"; shift; done\n\
         echo '| a result |'",
    );
    stub(&g.join("demo"), "");
    stub(&g.join("nccl_context"), "");
    fs::create_dir_all(g.join("python/tests")).unwrap();
    stub(
        &dir.join("bin/nvidia-smi"),
        "[ \"$1\" = -L ] && echo 'GPU 0: a stub GPU'\ntrue",
    );
    let wheels = dir.join("wheels/nvidia");
    fs::create_dir_all(wheels.join("nccl/lib")).unwrap();
    fs::write(wheels.join("nccl/lib/libnccl.so.2"), "").unwrap();
    // python3 finds the NCCL wheel; anything else it is asked passes.
    shell_script(
        &dir.join("bin/python3"),
        &format!(
            "case \"$*\" in *'import nvidia'*) echo {}; exit 0;; esac\necho \"python3 $*\"",
            wheels.display()
        ),
    );
    copy_script("gpu-lib.sh", &g);
    g
}

#[test]
fn gpu_check_runs_every_step_and_counts_the_tests() {
    let dir = scratch("check");
    let g = stub_machine(&dir);
    copy_script("gpu-check.sh", &g);
    let (status, out) = run_script(
        &dir,
        &g.join("gpu-check.sh"),
        &["540"],
        &[("EP_GPU_TEST_ARGS", "--skip leaks")],
    );
    assert_eq!(status, 1, "gpu_beta fails:\n{out}");
    assert_eq!(
        summary_rows(&out),
        rows(&[
            ("test gpu_alpha", "pass"),
            ("test gpu_beta", "fail(101)"),
            ("test gpu_low_latency", "pass"),
            ("test gpu_normal", "pass"),
            ("python torch tests", "pass"),
            ("python example host 2 ranks", "pass"),
            ("python example gpu", "pass"),
            ("nccl normal", "pass"),
            ("nccl low-latency", "pass"),
            ("nccl example 1 ranks", "pass"),
            ("demo gpu 1 ranks", "pass"),
            ("bench normal 1 ranks", "pass"),
            ("bench ll 1 ranks", "pass"),
            ("bench ll token sweep 1 ranks", "pass"),
            ("bench normal 2 ranks shared GPU", "pass"),
            ("bench ll 2 ranks shared GPU", "pass"),
            ("bench SM sweep 1 ranks", "pass"),
            ("bench token sweep 1 ranks", "pass"),
        ])
    );
    assert!(
        out.contains("\ntests: 7 passed, 2 failed, 1 parts skipped\n"),
        "{out}"
    );
    let read = |name: &str| fs::read_to_string(dir.join("out").join(name)).unwrap_or_default();
    assert!(read("test_gpu_alpha.log")
        .contains("gpu_alpha --ignored --test-threads=1 --show-output --skip leaks"));
    assert!(read("gpus.log").contains("GPU 0: a stub GPU"));
    assert!(read("bench_normal_1_ranks.json").starts_with("{}"));
    assert_eq!(read("results.md").matches("| a result |").count(), 7);

    // EP_GPU_TESTS_ONLY stops after the tests.
    let (status, out) = run_script(
        &dir,
        &g.join("gpu-check.sh"),
        &["540"],
        &[("EP_GPU_TESTS_ONLY", "1")],
    );
    assert_eq!(status, 1, "{out}");
    assert_eq!(summary_rows(&out).len(), 4, "{out}");
    assert!(out.contains("=== tests: 7 passed, 2 failed, 1 parts skipped\n"));
}

#[test]
fn gpu_mega_skips_the_tests_after_a_hang_and_benchmarks_single_blocks() {
    let dir = scratch("mega");
    let g = stub_machine(&dir);
    stub(
        &g.join("tests/gpu_mega"),
        "case \"$*\" in *decode_shape*) exec sleep 30;; esac",
    );
    copy_script("gpu-mega.sh", &g);
    let (status, out) = run_script(
        &dir,
        &g.join("gpu-mega.sh"),
        &["540", "tests,bench"],
        &[
            ("TEST_TIMEOUT", "1"),
            ("MEGA_CLUSTERS", "1,2"),
            ("MEGA_RANKS", "2"),
        ],
    );
    assert_eq!(status, 1, "{out}");
    assert_eq!(
        summary_rows(&out),
        rows(&[
            ("test small_and_uneven_cases_match_the_reference", "pass"),
            (
                "test both_calls_replay_in_a_cuda_graph_with_fresh_routing",
                "pass"
            ),
            ("test decode_shape_matches_the_reference", "timeout"),
            ("test w3_shape_matches_the_reference", "skipped"),
            ("bench fused vs unfused vs torch", "pass"),
        ])
    );
    // One log for every step; after the hang only the single-block kernels.
    let log = fs::read_to_string(dir.join("out/mega.log")).unwrap();
    assert!(log.contains("=== test decode_shape_matches_the_reference (timeout 1s)"));
    assert!(log.contains("mega_bench.py --lib"));
    assert!(log.contains("--clusters 1\n"), "{log}");
    // MEGA_RANKS goes to the benchmark, which then gets more time.
    assert!(log.contains("=== bench fused vs unfused vs torch (timeout 360s)"));
    assert!(log.contains("--ranks 2 --clusters 1\n"), "{log}");
    assert!(!log.contains("w3_shape"), "{log}");
}

/// Every file of .gpu/ the runner scripts use (`$G/NAME`) is named by
/// scripts/gpu-package.sh, and it copies the scripts with what they source.
#[test]
fn gpu_package_copies_what_the_runner_scripts_use() {
    let package = fs::read_to_string(root().join("scripts/gpu-package.sh")).unwrap();
    let copies: Vec<&str> = package
        .lines()
        .filter(|l| l.trim_start().starts_with("cp "))
        .collect();
    let copied = |script: &str| {
        copies
            .iter()
            .any(|l| l.contains(&format!("scripts/{script}")))
    };
    for script in ["gpu-check.sh", "gpu-mega.sh", "gpu-multi.sh"] {
        assert!(
            copied(script),
            "scripts/gpu-package.sh does not copy {script}"
        );
        let text = fs::read_to_string(root().join("scripts").join(script)).unwrap();
        for sourced in text
            .lines()
            .filter_map(|l| l.strip_prefix(". \"$(dirname \"$0\")/"))
        {
            let sourced = sourced.trim_end_matches('"');
            assert!(
                copied(sourced),
                "{script} sources {sourced}, which scripts/gpu-package.sh does not copy"
            );
        }
        for used in text.split("$G/").skip(1) {
            let end = used
                .find(|c: char| !(c.is_alphanumeric() || "_.-".contains(c)))
                .unwrap_or(used.len());
            let name = &used[..end];
            assert!(
                !name.is_empty() && package.contains(name),
                "{script} uses $G/{name}, which scripts/gpu-package.sh does not put into .gpu/"
            );
        }
    }
}

#[test]
fn gpu_multi_runs_each_part_and_packs_its_logs() {
    let dir = scratch("multi");
    let g = stub_machine(&dir);
    stub(
        &dir.join("bin/nvidia-smi"),
        "[ \"$1\" = -L ] && printf 'GPU 0: a stub GPU\\nGPU 1: a stub GPU\\n'\ntrue",
    );
    copy_script("gpu-multi.sh", &g);
    let (status, out) = run_script(&dir, &g.join("gpu-multi.sh"), &["tests", "540"], &[]);
    // The stub machine lacks most test binaries, and gpu_beta is in no lane.
    assert_eq!(status, 1, "{out}");
    let rows = summary_rows(&out);
    assert!(rows.contains(&("test gpu_normal (2 passed, 0 failed)".into(), "pass".into())));
    assert!(rows.contains(&(
        "test gpu_context (0 passed, 0 failed)".into(),
        "missing".into()
    )));
    // The leak test is gpu_context's, which the stub machine lacks.
    assert!(rows.contains(&("leak test alone".into(), "fail(127)".into())));
    for step in [
        "repeat gpu_normal x10000",
        "repeat gpu_low_latency x10000",
        "shared GPU gpu_normal world 2",
        "shared GPU gpu_normal world 8",
        "python torch tests",
        "nccl low-latency",
        "nccl example 2 ranks",
        "demo gpu 2 ranks",
    ] {
        assert!(
            rows.contains(&(step.into(), "pass".into())),
            "{step}:\n{out}"
        );
    }
    // Everything is packed into logs.tgz, with the summary beside it.
    let listing = Command::new("tar")
        .arg("-tzf")
        .arg(dir.join("out/logs-tests.tgz"))
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    // gpu_normal runs alone with a GPU per rank (its own part; 2 stub
    // GPUs: worlds 1 and 2), and a world size per step on one GPU.
    let lane_log = Command::new("tar")
        .arg("-xzOf")
        .arg(dir.join("out/logs-tests.tgz"))
        .arg("gpu-multi/test_gpu_normal.log")
        .output()
        .unwrap();
    let lane_log = String::from_utf8_lossy(&lane_log.stdout);
    assert!(lane_log.contains("worlds 1,2"), "{lane_log}");
    for world in ["2", "4", "8"] {
        assert!(out.contains(&format!("worlds {world}\n")), "{out}");
    }
    for log in ["gpu-multi/test_gpu_normal.log", "gpu-multi/gpus.log"] {
        assert!(
            listing.lines().any(|l| l == log),
            "{log} not in:\n{listing}"
        );
    }
    let summary = fs::read_to_string(dir.join("out/summary-tests.txt")).unwrap();
    assert!(summary.contains("repeat gpu_normal x10000"), "{summary}");

    let (status, out) = run_script(&dir, &g.join("gpu-multi.sh"), &["bench", "540"], &[]);
    assert_eq!(status, 0, "{out}");
    assert!(dir.join("out/logs-bench.tgz").is_file());
    let steps: Vec<String> = summary_rows(&out).into_iter().map(|(s, _)| s).collect();
    assert_eq!(
        steps,
        [
            "W1 normal 2 ranks",
            "W2 ll 2 ranks",
            "W3 fused 2 ranks",
            "W1 SM sweep 2 ranks",
            "W3 fused 1 rank",
            "traffic 2 ranks 1 per node",
        ]
    );
    assert!(out.contains("mega_bench.py --lib"), "{out}");
    assert!(out.contains("--iters 20 --ranks 2"), "{out}");
}
