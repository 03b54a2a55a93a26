//! The kernels' generated header, `ep_abi.h` (src/abi), checked with the
//! host C++ compiler: as generated it compiles, so its static_asserts agree
//! with the Rust layouts; with a field moved it does not, so those asserts
//! are what stands between a changed struct and a kernel reading the wrong
//! bytes. (The same layouts hold in device code: the types are fixed-size.)

mod common;

use common::tools::{c_compiler, fresh_dir, nvidia_wheels};
use std::path::{Path, PathBuf};
use std::process::Command;

/// CUDA's headers (for cuda_bf16.h), from the toolkit scripts/test.sh
/// installs into .venv, or from $CUDA_HOME.
fn cuda_include() -> PathBuf {
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        return Path::new(&home).join("include");
    }
    nvidia_wheels("cu13/include/cuda_bf16.h").join("cu13/include")
}

/// Whether a translation unit that includes `header` as ep_abi.h compiles;
/// also returns the compiler's messages.
fn compiles(header: &str, name: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("ep-abi-{}-{name}", std::process::id()));
    let dir = fresh_dir(dir);
    std::fs::write(dir.join("ep_abi.h"), header).unwrap();
    std::fs::write(dir.join("main.cpp"), "#include \"ep_abi.h\"\n").unwrap();
    // The system C++ compiler, as cc finds it: $CXX, else c++.
    let out = Command::new(c_compiler(true))
        .args(["-std=c++17", "-fsyntax-only", "-I"])
        .arg(&dir)
        .arg("-I")
        .arg(cuda_include())
        .arg(dir.join("main.cpp"))
        .output()
        .expect("no C++ compiler (c++ or $CXX)");
    std::fs::remove_dir_all(&dir).ok();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_generated_header_compiles() {
    let (ok, messages) = compiles(&ep::abi::c_header(), "good");
    assert!(ok, "ep_abi.h does not compile:\n{messages}");
}

#[test]
fn a_moved_field_fails_the_layout_asserts() {
    let header = ep::abi::c_header();
    // Swap two int fields of LlParams: same size, other offsets.
    let moved = header.replacen(
        "    int32_t do_send;\n    int32_t do_recv;\n",
        "    int32_t do_recv;\n    int32_t do_send;\n",
        1,
    );
    assert_ne!(moved, header, "the test's edit did not apply");
    let (ok, messages) = compiles(&moved, "moved");
    assert!(!ok, "a header with a moved field compiled");
    assert!(
        messages.contains("LlParams.do_send: offset differs"),
        "{messages}"
    );
}
