//! The examples and the C API test, built against the cdylib of this build
//! and run on the host backend: examples-c/demo.c (4 and 2 ranks as
//! processes), examples-c/demo.cpp (4 ranks as threads), examples-c/demo.py
//! (2 ranks, ctypes; skipped without python3) and tests/c/api_test.c;
//! examples-c/nccl_context.c is only compiled (it needs GPUs).

mod common;

use common::tools::{available, c_compiler, nvidia_wheels, root, run};
use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>`: this test runs from `target/<profile>/deps/`, and
/// `cargo build` of the same profile puts the library's cdylib next to
/// `deps/` (`cargo test` alone does not build it; scripts/test.sh does both).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test executable directory");
    let dir = deps.parent().expect("target/<profile>").to_path_buf();
    assert!(
        dir.join("libep.so").is_file(),
        "no libep.so in {}: run `cargo build` with the same profile first (scripts/test.sh does)",
        dir.display()
    );
    dir
}

fn out_dir() -> PathBuf {
    let dir = lib_dir().join("examples-test");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `source` into `out_dir()/name` with the strict flags, linked to
/// libep with an rpath to it.
fn build(source: &str, name: &str, cpp: bool) -> PathBuf {
    let lib = lib_dir();
    let exe = out_dir().join(name);
    let mut cmd = Command::new(c_compiler(cpp));
    cmd.arg(if cpp { "-std=c++17" } else { "-std=c99" })
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join(source))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lep")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-ldl", "-lm", "-pthread"]);
    run(&mut cmd, &format!("compiling {source}"));
    exe
}

/// Runs `cmd` on the host backend and asserts it succeeds; returns stdout.
fn run_ok(mut cmd: Command, what: &str) -> String {
    let out = run(cmd.env("EP_BACKEND", "host"), what);
    println!("{what}:\n{out}");
    out
}

#[test]
fn c_demo_4_and_2_ranks() {
    let exe = build("examples-c/demo.c", "demo", false);
    for ranks in [4, 2] {
        let mut cmd = Command::new(&exe);
        cmd.arg(ranks.to_string());
        let out = run_ok(cmd, &format!("demo {ranks}"));
        assert!(
            out.contains(&format!("demo: all {ranks} ranks passed")),
            "{out}"
        );
        assert_eq!(
            out.matches(": ok").count(),
            ranks,
            "one ok line per rank:\n{out}"
        );
    }
}

#[test]
fn cpp_demo_threads() {
    let exe = build("examples-c/demo.cpp", "demo_cpp", true);
    let out = run_ok(Command::new(exe), "demo.cpp");
    assert!(out.contains("demo.cpp: all 4 ranks passed"), "{out}");
}

#[test]
fn python_demo() {
    if !available("python3") {
        eprintln!("python3 not found: skipping demo.py");
        return;
    }
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("examples-c/demo.py"))
        .arg(lib_dir().join("libep.so"));
    let out = run_ok(cmd, "demo.py");
    assert!(out.contains("demo.py: all 2 ranks passed"), "{out}");
}

#[test]
fn c_api_test() {
    let exe = build("tests/c/api_test.c", "api_test", false);
    let out = run_ok(Command::new(exe), "api_test");
    let last = out.lines().last().unwrap_or("");
    assert!(
        last.ends_with(" passed, 0 failed") && !last.starts_with("0 passed"),
        "unexpected summary {last:?}:\n{out}"
    );
}

/// examples-c/nccl_context.c compiles against the pinned NCCL wheel's
/// nccl.h and links its libnccl.so.2 and the CUDA runtime wheel's library.
/// It needs a GPU to run (scripts/gpu-check.sh runs it).
#[test]
fn nccl_example_builds() {
    let wheels = nvidia_wheels("nccl/include/nccl.h");
    let lib = lib_dir();
    let exe = out_dir().join("nccl_context");
    let mut cmd = Command::new(c_compiler(false));
    cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(root().join("include"))
        .arg("-I")
        .arg(wheels.join("nccl/include"))
        .arg("-I")
        .arg(wheels.join("cu13/include"))
        .arg(root().join("examples-c/nccl_context.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lep")
        .arg(format!("-L{}", wheels.join("nccl/lib").display()))
        .arg("-l:libnccl.so.2")
        .arg(format!("-L{}", wheels.join("cu13/lib").display()))
        .arg("-l:libcudart.so.13");
    run(&mut cmd, "compiling examples-c/nccl_context.c");
    assert!(exe.is_file());
}
