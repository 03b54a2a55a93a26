//! The checked-in header is what cbindgen makes of src/capi today, and it
//! compiles cleanly as C99 and C++17, also when included twice.

mod common;

use common::tools::{c_compiler, root, run};
use std::path::Path;
use std::process::Command;

fn generated_header() -> String {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root())
        .with_config(config)
        .generate()
        .expect("cbindgen failed")
        .write(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn header_is_up_to_date() {
    let fresh = generated_header();
    let path = root().join("include/ep.h");
    if std::env::var_os("EP_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "include/ep.h is stale: run scripts/gen-header.sh and commit the result"
    );
}

/// Compiles a translation unit that includes the header twice.
fn compile(compiler: &Path, args: &[&str], ext: &str) {
    let dir = std::env::temp_dir().join(format!("ep-header-{}-{ext}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("twice.{ext}"));
    std::fs::write(
        &src,
        "#include \"ep.h\"\n#include \"ep.h\"\n\
         int main(void) { ep_config_t c; ep_config_init(&c); return (int)c.hidden == 0; }\n",
    )
    .unwrap();
    run(
        Command::new(compiler)
            .args(args)
            .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only"])
            .arg("-I")
            .arg(root().join("include"))
            .arg(&src),
        &format!("{} {args:?} on include/ep.h", compiler.display()),
    );
}

#[test]
fn header_compiles_as_c99() {
    compile(&c_compiler(false), &["-std=c99"], "c");
}

#[test]
fn header_compiles_as_cpp17() {
    compile(&c_compiler(true), &["-std=c++17"], "cpp");
}

/// cbindgen sees every `pub const` of the crate: only the C boundary's may
/// reach the header, all named `EP_*` (types `ep_*`).
#[test]
fn header_exports_only_ep_names() {
    let header = std::fs::read_to_string(root().join("include/ep.h")).unwrap();
    for line in header.lines() {
        if let Some(rest) = line.strip_prefix("#define ") {
            assert!(
                rest.starts_with("EP_"),
                "foreign macro in include/ep.h: {line}"
            );
        }
        if let Some(rest) = line.strip_prefix("typedef struct ") {
            assert!(
                rest.starts_with("ep_") || rest.starts_with("CUstream_st"),
                "foreign type in include/ep.h: {line}"
            );
        }
    }
}

/// python/ep/_abi.py is what scripts/gen-python-abi.py makes of the header
/// (scripts/gen-header.sh regenerates both).
#[test]
fn python_abi_is_up_to_date() {
    run(
        Command::new("python3")
            .arg(root().join("scripts/gen-python-abi.py"))
            .arg("--check"),
        "python3 scripts/gen-python-abi.py --check",
    );
}
