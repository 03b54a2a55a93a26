//! Rules of the kernel sources that no compiler checks.
//!
//! ep kernels are launched as programmatic dependents where the runtime can
//! (src/runtime/gpu/mod.rs, `programmatic_launch`): their blocks may start
//! before the kernel ahead of it on the stream has finished. That is only correct
//! because each kernel's first statement is `ep_kernel_start()`
//! (kernels/include/ep_device.cuh), which waits for that kernel. A kernel
//! added without it would read its inputs while they are still being
//! written, a race no test on one small input may catch.

use std::path::Path;

/// The call every kernel body starts with.
const START: &str = "ep_kernel_start();";

/// Each `extern "C" __global__` definition in `source`: the kernel's name
/// and the first statement of its body.
fn kernels(source: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("extern \"C\" __global__") {
        let after = &rest[at..];
        let Some(open) = after.find('{') else { break };
        let signature = &after[..open];
        // The name is the word before the parameter list (the last
        // parenthesis: attributes such as __launch_bounds__(...) come first).
        let name = signature
            .rfind('(')
            .and_then(|params| signature[..params].split_whitespace().last())
            .unwrap_or("?")
            .to_string();
        let body = after[open + 1..].trim_start();
        let first = body.split_inclusive(';').next().unwrap_or("").to_string();
        found.push((name, first));
        rest = &after[open + 1..];
    }
    found
}

#[test]
fn every_kernel_starts_by_waiting_for_the_kernel_ahead() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut checked = 0;
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        for (name, first) in kernels(&source) {
            checked += 1;
            if first.trim() != START {
                missing.push(format!(
                    "{}: {name} starts with {:?}",
                    path.display(),
                    first.trim()
                ));
            }
        }
    }
    assert!(
        checked >= 20,
        "found only {checked} kernels in {}",
        dir.display()
    );
    assert!(
        missing.is_empty(),
        "kernels that do not start with {START}:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_check_sees_a_kernel_without_the_wait() {
    let source = "extern \"C\" __global__ void __launch_bounds__(256)\n    \
                  k(const P p) {\n    int x = 0;\n    ep_kernel_start();\n}\n\
                  extern \"C\" __global__ void j(const P p) {\n    ep_kernel_start();\n}\n";
    let found = kernels(source);
    assert_eq!(
        found,
        vec![
            ("k".to_string(), "int x = 0;".to_string()),
            ("j".to_string(), START.to_string()),
        ]
    );
}
