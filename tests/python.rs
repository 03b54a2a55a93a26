//! The Python package (python/ep) and the benchmark plot script
//! (bench/plot.py), in a virtual environment under target/ made with
//! `python3 -m venv` and the pinned packages of python/requirements-test.txt
//! (numpy, pytest, matplotlib; no torch). The package is installed the way a
//! user installs it, `pip install <checkout>` (its build hook runs `cargo
//! build --release --lib`, a no-op after scripts/test.sh's build), then its
//! tests run on the host backend. Needs python3 with venv and pip access to
//! PyPI.

mod common;

use common::tools::{fresh_dir, root, run};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The test environment's python, made once (and again when the
/// requirements change).
fn python() -> PathBuf {
    static VENV: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut venv = VENV.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(python) = venv.as_ref() {
        return python.clone();
    }
    let dir = root().join("target/python-venv");
    let python = dir.join("bin/python");
    let requirements = root().join("python/requirements-test.txt");
    let wanted = std::fs::read_to_string(&requirements).unwrap();
    let marker = dir.join("requirements-installed.txt");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(wanted.as_str()) {
        let _ = std::fs::remove_dir_all(&dir);
        run(
            Command::new("python3").args(["-m", "venv"]).arg(&dir),
            "python3 -m venv (on Debian: apt-get install python3-venv)",
        );
        pip_install(&python, &["-r".as_ref(), requirements.as_os_str()]);
        std::fs::write(&marker, &wanted).unwrap();
    }
    *venv = Some(python.clone());
    python
}

/// `python -m pip install --quiet ARGS`.
fn pip_install(python: &Path, args: &[&OsStr]) {
    run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(args),
        &format!("pip install {args:?}"),
    );
}

/// Installs the package from this checkout into the test environment.
fn install_package(python: &Path) {
    let checkout = root();
    pip_install(
        python,
        &[
            "--force-reinstall".as_ref(),
            "--no-deps".as_ref(),
            checkout.as_os_str(),
        ],
    );
}

#[test]
fn python_package_installs_and_passes_its_host_tests() {
    let python = python();
    install_package(&python);
    // The installed package bundles the library; EP_LIBRARY would override it.
    let out = run(
        Command::new(&python)
            .args(["-c", "import ep; print(ep.library_path())"])
            .env_remove("EP_LIBRARY")
            .current_dir(std::env::temp_dir()),
        "import ep",
    );
    assert!(
        out.trim().ends_with("site-packages/ep/libep.so"),
        "the installed package does not load its bundled library: {out}"
    );
    let out = run(
        Command::new(&python)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(root().join("python/tests"))
            .env_remove("EP_LIBRARY")
            .env("EP_BACKEND", "host")
            .current_dir(std::env::temp_dir()),
        "pytest python/tests",
    );
    println!("{out}");
    let summary = out.lines().last().unwrap_or("");
    assert!(
        summary.contains(" passed") && !summary.contains("failed"),
        "unexpected pytest summary: {summary}"
    );
}

/// Whether `dir` holds a PNG file called `name`.
fn is_png(dir: &Path, name: &str) -> bool {
    std::fs::read(dir.join(name))
        .map(|b| b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 1000)
        .unwrap_or(false)
}

fn scratch(name: &str) -> PathBuf {
    fresh_dir(root().join("target/plot-test").join(name))
}

const PLOTS: [&str; 5] = [
    "normal-tokens.png",
    "normal-sms.png",
    "ll-tokens.png",
    "vs-nccl.png",
    "vs-deepep.png",
];

/// bench/data is what bench/results_to_json.py makes of bench/RESULTS.md,
/// and bench/plot.py renders every plot of it (and, without matplotlib,
/// still processes the data and says that it skipped rendering).
#[test]
fn plot_script_renders_the_recorded_runs() {
    let python = python();
    let converted = scratch("converted");
    run(
        Command::new(&python)
            .arg(root().join("bench/results_to_json.py"))
            .arg("--out")
            .arg(&converted),
        "bench/results_to_json.py",
    );
    for entry in std::fs::read_dir(&converted).unwrap() {
        let name = entry.unwrap().file_name();
        let recorded = root().join("bench/data").join(&name);
        assert_eq!(
            std::fs::read_to_string(converted.join(&name)).unwrap(),
            std::fs::read_to_string(&recorded).unwrap_or_default(),
            "bench/data/{} differs from what bench/results_to_json.py makes of bench/RESULTS.md",
            name.to_string_lossy()
        );
    }

    let out_dir = scratch("plots");
    let out = run(
        Command::new(&python)
            .arg(root().join("bench/plot.py"))
            .arg("--out")
            .arg(&out_dir),
        "bench/plot.py",
    );
    println!("{out}");
    // Every recorded run is read: the ep-bench files of bench/data (the
    // others are reference figures, such as DeepEP's).
    let runs = std::fs::read_dir(root().join("bench/data"))
        .unwrap()
        .filter(|entry| {
            let path = entry.as_ref().unwrap().path();
            std::fs::read_to_string(path)
                .unwrap()
                .contains("\"schema\": \"ep-bench/1\"")
        })
        .count();
    assert!(
        out.contains(&format!("{runs} runs, 1 reference files, 5 plots")),
        "{out}"
    );
    assert!(
        out.contains("vs-deepep: 5 pairs of bars") && out.contains("normal-sms: 2 panels"),
        "{out}"
    );
    for png in PLOTS {
        assert!(is_png(&out_dir, png), "{png} was not rendered:\n{out}");
    }

    // Without matplotlib: the data part runs, rendering is skipped, loudly.
    let no_mpl = scratch("no-matplotlib");
    let out = run(
        Command::new(&python)
            .args([
                "-c",
                "import runpy, sys; sys.modules['matplotlib'] = None; \
                 script, out = sys.argv[1:3]; sys.argv = [script, '--out', out]; \
                 runpy.run_path(script, run_name='__main__')",
            ])
            .arg(root().join("bench/plot.py"))
            .arg(&no_mpl),
        "bench/plot.py without matplotlib",
    );
    assert!(out.contains("5 plots"), "{out}");
    assert!(
        out.contains("matplotlib is not installed: rendering skipped"),
        "{out}"
    );
    assert!(!is_png(&no_mpl, "normal-tokens.png"));
}

/// ep-bench's own --json output (host backend) goes through the plot script.
#[test]
fn plot_script_takes_a_fresh_ep_bench_json() {
    let python = python();
    let dir = scratch("fresh");
    let json = dir.join("run.json");
    run(
        Command::new(env!("CARGO_BIN_EXE_ep-bench"))
            .args(["--backend", "host", "--ranks", "2", "--hidden", "256"])
            .args([
                "--experts",
                "8",
                "--topk",
                "2",
                "--iters",
                "2",
                "--warmup",
                "1",
            ])
            .args(["--mode", "all", "--sweep-tokens", "2,4,8", "--json"])
            .arg(&json),
        "ep-bench --json",
    );
    let out = run(
        Command::new(&python)
            .arg(root().join("bench/plot.py"))
            .arg(&json)
            .arg("--out")
            .arg(&dir),
        "bench/plot.py on a fresh run",
    );
    println!("{out}");
    assert!(out.contains("1 runs, 0 reference files, 2 plots"), "{out}");
    assert!(is_png(&dir, "normal-tokens.png") && is_png(&dir, "ll-tokens.png"));
}
