//! The Python package (python/ep) and the benchmark plot script
//! (bench/plot.py), in a virtual environment under target/ made with
//! `python3 -m venv` and the pinned packages of python/requirements-test.txt
//! (numpy, pytest, matplotlib; no torch). The package is installed the way a
//! user installs it, `pip install <checkout>` (its build hook runs `cargo
//! build --release --lib`, a no-op after scripts/test.sh's build), then its
//! tests run on the host backend. Needs python3 with venv and pip access to
//! PyPI.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn show(output: &Output) -> String {
    format!(
        "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn run(cmd: &mut Command, what: &str) -> String {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(output.status.success(), "{what} failed:\n{}", show(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

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
        run(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "-r",
                ])
                .arg(&requirements),
            "pip install -r python/requirements-test.txt",
        );
        std::fs::write(&marker, &wanted).unwrap();
    }
    *venv = Some(python.clone());
    python
}

/// Installs the package from this checkout into the test environment.
fn install_package(python: &Path) {
    run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(["--force-reinstall", "--no-deps"])
            .arg(root()),
        "pip install <checkout>",
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
