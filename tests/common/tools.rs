//! Running the system's tools from tests: the C and C++ compilers, other
//! commands, and their output in failure messages.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `dir`, emptied: removed with everything in it, then made again.
pub fn fresh_dir(dir: PathBuf) -> PathBuf {
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The NVIDIA wheels' directory under `.venv/` (`.../site-packages/nvidia`)
/// that holds `file`: scripts/install-cuda-tools.sh puts the CUDA toolkit's
/// headers, the pinned NCCL and the CUDA runtime there.
pub fn nvidia_wheels(file: &str) -> PathBuf {
    let lib = root().join(".venv/lib");
    std::fs::read_dir(&lib)
        .unwrap_or_else(|e| panic!("{}: {e}: run scripts/install-cuda-tools.sh", lib.display()))
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join("site-packages/nvidia"))
        .find(|dir| dir.join(file).is_file())
        .unwrap_or_else(|| {
            panic!("no {file} in the NVIDIA wheels under .venv: run scripts/install-cuda-tools.sh")
        })
}

/// The system C or C++ compiler, as cc finds it (honours `CC` and `CXX`).
pub fn c_compiler(cpp: bool) -> PathBuf {
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    cc::Build::new()
        .cpp(cpp)
        .opt_level(0)
        .debug(false)
        .cargo_metadata(false)
        .target(&target)
        .host(&target)
        .get_compiler()
        .path()
        .to_path_buf()
}

/// A command's status and output, for an assertion message.
pub fn show(output: &Output) -> String {
    format!(
        "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `cmd`, asserts it succeeds, returns its stdout.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(output.status.success(), "{what} failed:\n{}", show(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether `program` runs (`program --version` succeeds).
pub fn available(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}
