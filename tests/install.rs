//! The C and C++ install (scripts/install.sh) and its consumers: installs to
//! a prefix under target/, builds the C demo through pkg-config and the
//! examples-c CMake project through find_package(ep) (shared and static),
//! runs them on the host backend, moves the installed tree (the pkg-config
//! and CMake files find their prefix from their own place) and stages an
//! install under DESTDIR. Needs cmake and pkg-config (.ci/run installs them).

mod common;

use common::tools::{available, c_compiler, fresh_dir, root, run};
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch() -> PathBuf {
    fresh_dir(root().join("target/install-test"))
}

fn install(prefix: &Path, destdir: Option<&Path>) {
    let mut cmd = Command::new(root().join("scripts/install.sh"));
    cmd.arg(prefix).env_remove("LIBDIR").env_remove("PREFIX");
    match destdir {
        Some(d) => cmd.env("DESTDIR", d),
        None => cmd.env_remove("DESTDIR"),
    };
    run(&mut cmd, "scripts/install.sh");
}

/// Runs an example on the host backend and checks its summary line.
fn run_demo(exe: &Path, args: &[&str], want: &str, env: &[(&str, &Path)]) {
    let mut cmd = Command::new(exe);
    cmd.args(args).env("EP_BACKEND", "host");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(&mut cmd, &exe.display().to_string());
    assert!(
        out.contains(want),
        "{}: no {want:?} in\n{out}",
        exe.display()
    );
}

/// Configures and builds examples-c/CMakeLists.txt against the ep installed
/// under `prefix`, in `build` (`build_args`: more `cmake --build` arguments).
fn cmake_examples(prefix: &Path, build: &Path, build_args: &[&str]) {
    run(
        Command::new("cmake")
            .arg("-S")
            .arg(root().join("examples-c"))
            .arg("-B")
            .arg(build)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display())),
        &format!("cmake configure examples-c against {}", prefix.display()),
    );
    run(
        Command::new("cmake")
            .arg("--build")
            .arg(build)
            .arg("-j2")
            .args(build_args),
        "cmake --build examples-c",
    );
}

fn pkg_config(pc_dir: &Path, args: &[&str]) -> Vec<String> {
    let out = run(
        Command::new("pkg-config")
            .args(args)
            .arg("ep")
            .env("PKG_CONFIG_PATH", pc_dir),
        "pkg-config",
    );
    out.split_whitespace().map(str::to_string).collect()
}

#[test]
fn installed_library_builds_with_pkg_config_and_cmake() {
    for tool in ["cmake", "pkg-config"] {
        assert!(
            available(tool),
            "{tool} is not installed (apt-get install cmake pkg-config; .ci/run does)"
        );
    }
    let dir = scratch();
    let prefix = dir.join("prefix");
    install(&prefix, None);
    for file in [
        "lib/libep.so",
        "lib/libep.a",
        "include/ep.h",
        "lib/pkgconfig/ep.pc",
        "lib/cmake/ep/epConfig.cmake",
        "lib/cmake/ep/epConfigVersion.cmake",
    ] {
        assert!(prefix.join(file).is_file(), "{file} was not installed");
    }
    assert_eq!(
        std::fs::read(prefix.join("include/ep.h")).unwrap(),
        std::fs::read(root().join("include/ep.h")).unwrap()
    );

    // The C demo through pkg-config, as a Makefile would build it.
    let pc_dir = prefix.join("lib/pkgconfig");
    assert_eq!(
        pkg_config(&pc_dir, &["--modversion"]),
        [env!("CARGO_PKG_VERSION")]
    );
    let demo = dir.join("demo-pkg-config");
    run(
        Command::new(c_compiler(false))
            .args([
                "-std=c99",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
            ])
            .args(pkg_config(&pc_dir, &["--cflags"]))
            .arg(root().join("examples-c/demo.c"))
            .arg("-o")
            .arg(&demo)
            .args(pkg_config(&pc_dir, &["--libs"]))
            .args(["-ldl", "-lm"])
            .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display())),
        "cc demo.c $(pkg-config --cflags --libs ep)",
    );
    run_demo(&demo, &["2"], "demo: all 2 ranks passed", &[]);

    // The CMake project of examples-c through find_package(ep).
    let build = dir.join("cmake-build");
    cmake_examples(&prefix, &build, &[]);
    run_demo(&build.join("demo"), &["2"], "demo: all 2 ranks passed", &[]);
    run_demo(
        &build.join("demo_static"),
        &["2"],
        "demo: all 2 ranks passed",
        &[],
    );
    run_demo(
        &build.join("demo_cpp"),
        &[],
        "demo.cpp: all 4 ranks passed",
        &[],
    );
    let needed = run(
        Command::new("readelf")
            .arg("-d")
            .arg(build.join("demo_static")),
        "readelf",
    );
    assert!(
        !needed.contains("libep.so"),
        "demo_static links libep.so:\n{needed}"
    );

    // A moved tree still describes itself.
    let moved = dir.join("moved");
    std::fs::rename(&prefix, &moved).unwrap();
    let cflags = pkg_config(&moved.join("lib/pkgconfig"), &["--cflags"]);
    assert_eq!(cflags.len(), 1, "{cflags:?}");
    let include = PathBuf::from(cflags[0].trim_start_matches("-I"));
    assert_eq!(
        include.canonicalize().unwrap(),
        moved.join("include").canonicalize().unwrap()
    );
    let build2 = dir.join("cmake-build-moved");
    cmake_examples(&moved, &build2, &["--target", "demo"]);
    run_demo(
        &build2.join("demo"),
        &["2"],
        "demo: all 2 ranks passed",
        &[],
    );
}

#[test]
fn destdir_stages_the_install_under_it() {
    let dir = root().join("target/install-test-destdir");
    let _ = std::fs::remove_dir_all(&dir);
    install(Path::new("/opt/ep"), Some(&dir));
    for file in ["lib/libep.so", "include/ep.h", "lib/pkgconfig/ep.pc"] {
        assert!(dir.join("opt/ep").join(file).is_file(), "{file} not staged");
    }
}
