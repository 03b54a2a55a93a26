//! Compiles each CUDA kernel file `kernels/<name>.cu` into a fatbin,
//! `$OUT_DIR/kernels/<name>.fatbin`, and writes `$OUT_DIR/ep_kernels.rs`, the
//! list of them that `src/runtime/cuda.rs` embeds and loads through the
//! driver API at run time (one module per file). Nothing CUDA is linked.
//!
//! Each fatbin holds machine code (SASS) for every target architecture and
//! `compute_90` PTX, which the driver compiles for GPUs newer than the
//! targets. Code that needs Hopper-only instructions guards itself with
//! `__CUDA_ARCH_FEAT_SM90_ALL` and reports "unsupported" elsewhere.
//!
//! `ep_abi.h`, the kernels' view of the structs and constants of
//! src/abi/defs.rs, is generated first, into `$OUT_DIR/include`.
//!
//! The network kernels use NCCL's device API, which is header-only: they are
//! compiled against the headers of the pinned NCCL wheel
//! (`nvidia-nccl-cu13`, installed into `.venv/` by
//! `scripts/install-cuda-tools.sh`, never copied into the repository). The
//! headers' `NCCL_VERSION_CODE` becomes `EP_NCCL_VERSION_CODE` for the Rust
//! side, which refuses at run time an NCCL library of another version.
//!
//! Environment:
//! - `NVCC`: the nvcc to use. Otherwise `$CUDA_HOME/bin/nvcc`, then `nvcc` on
//!   PATH, then the one `scripts/install-cuda-tools.sh` put in `.venv/`.
//! - `EP_CUTLASS_INCLUDE`: the CUTLASS/CuTe headers (the directory holding
//!   `cute/` and `cutlass/`) that the fused kernels build on. Otherwise the
//!   ones of the `nvidia-cutlass` wheel `scripts/install-cuda-tools.sh` put
//!   in `.venv/`.
//! - `EP_CUDA_ARCHS`: comma list of targets, such as `90a,100a`. Default:
//!   `90a` (Hopper), plus `100a` (Blackwell) when this nvcc knows it.
//! - `EP_NCCL_INCLUDE`: the NCCL include directory (holding `nccl.h` and
//!   `nccl_device.h`). Otherwise the wheel's, under `.venv/`.

use std::env;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The structs and constants shared with the runtime, to generate
/// `ep_abi.h` from (see src/abi/mod.rs).
#[allow(dead_code)]
mod abi {
    include!("src/abi/gen.rs");
    include!("src/abi/defs.rs");
}

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/abi");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "EP_CUDA_ARCHS",
        "EP_CUTLASS_INCLUDE",
        "EP_NCCL_INCLUDE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Err(message) = build() {
        // Cargo shows a failed build script's stderr in full.
        eprintln!("building the CUDA kernels failed:\n{message}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let kernels_dir = manifest_dir.join("kernels");

    let nvcc = find_nvcc(&manifest_dir)?;
    let cutlass = find_cutlass(&manifest_dir)?;
    let archs = target_archs(&nvcc)?;
    let mut gencode: Vec<String> = archs
        .iter()
        .map(|arch| format!("-gencode=arch=compute_{arch},code=sm_{arch}"))
        .collect();
    gencode.push(format!(
        "-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"
    ));

    let nccl_include = find_nccl_include(&manifest_dir)?;
    println!(
        "cargo:rustc-env=EP_NCCL_VERSION_CODE={}",
        nccl_version_code(&nccl_include)?
    );

    let sources = cuda_sources(&kernels_dir)?;
    let objects_dir = out_dir.join("kernels");
    std::fs::create_dir_all(&objects_dir).map_err(|e| format!("{}: {e}", objects_dir.display()))?;

    // The generated header of the shared structs and constants.
    let abi_dir = out_dir.join("include");
    std::fs::create_dir_all(&abi_dir).map_err(|e| format!("{}: {e}", abi_dir.display()))?;
    let abi_header = abi_dir.join("ep_abi.h");
    std::fs::write(&abi_header, abi::c_header())
        .map_err(|e| format!("{}: {e}", abi_header.display()))?;

    // All files at once: nvcc is single-threaded and slow.
    let include_dir = kernels_dir.join("include");
    let compiles: Vec<(Command, String, PathBuf)> = sources
        .iter()
        .map(|source| {
            let stem = source
                .file_stem()
                .unwrap_or(OsStr::new("kernel"))
                .to_string_lossy()
                .into_owned();
            let fatbin = objects_dir.join(&stem).with_extension("fatbin");
            let mut cmd = Command::new(&nvcc);
            // `-compress-mode=size`: the fatbins are embedded in every
            // binary that links the library (each test, ep-bench), and
            // NCCL's device code makes them large; the driver unpacks them
            // once, when a context loads the module.
            cmd.args(["-fatbin", "-std=c++17", "-O3", "-lineinfo"])
                .arg("-compress-mode=size")
                .arg("--expt-relaxed-constexpr")
                .arg("-I")
                .arg(&include_dir)
                .arg("-I")
                .arg(&abi_dir)
                .arg("-isystem")
                .arg(&cutlass)
                .arg("-I")
                .arg(&nccl_include)
                .args(&gencode)
                .arg(source)
                .arg("-o")
                .arg(&fatbin);
            (cmd, stem, fatbin)
        })
        .collect();
    let fatbins = std::thread::scope(|scope| {
        let running: Vec<_> = compiles
            .into_iter()
            .map(|(mut cmd, stem, fatbin)| {
                scope.spawn(move || run(&mut cmd).map(|()| (stem, fatbin)))
            })
            .collect();
        running
            .into_iter()
            .map(|handle| handle.join().expect("an nvcc thread panicked"))
            .collect::<Result<Vec<(String, PathBuf)>, String>>()
    })?;

    // The list the library embeds: (file name, fatbin), 8-byte aligned
    // (`Aligned` is defined where this is included).
    let mut list = String::from(
        "// Generated by build.rs: every kernels/*.cu, compiled.\n\
         pub static KERNEL_IMAGES: &[(&str, &Aligned<[u8]>)] = &[\n",
    );
    for (stem, fatbin) in &fatbins {
        list.push_str(&format!(
            "    ({stem:?}, &Aligned(*include_bytes!({:?}))),\n",
            fatbin.display().to_string()
        ));
    }
    list.push_str("];\n");
    let list_path = out_dir.join("ep_kernels.rs");
    std::fs::write(&list_path, list).map_err(|e| format!("{}: {e}", list_path.display()))
}

/// Runs one nvcc command. On failure the error holds the command line and
/// nvcc's whole output; on success its warnings are passed on to cargo.
fn run(cmd: &mut Command) -> Result<(), String> {
    let output = cmd
        .output()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!(
            "command failed ({}):\n  {cmd:?}\n{stdout}{stderr}",
            output.status
        ));
    }
    for line in stdout.lines().chain(stderr.lines()) {
        println!("cargo:warning=nvcc: {line}");
    }
    Ok(())
}

/// The nvcc to use; see the file comment for the order.
fn find_nvcc(manifest_dir: &Path) -> Result<PathBuf, String> {
    if let Some(nvcc) = env::var_os("NVCC") {
        return Ok(PathBuf::from(nvcc));
    }
    if let Some(cuda_home) = env::var_os("CUDA_HOME") {
        let nvcc = PathBuf::from(cuda_home).join("bin/nvcc");
        if nvcc.is_file() {
            return Ok(nvcc);
        }
    }
    if let Some(path) = env::var_os("PATH") {
        if let Some(nvcc) = env::split_paths(&path)
            .map(|dir| dir.join("nvcc"))
            .find(|nvcc| nvcc.is_file())
        {
            return Ok(nvcc);
        }
    }
    if let Some(nvcc) = venv_nvcc(manifest_dir) {
        return Ok(nvcc);
    }
    Err(
        "no nvcc found (tried $NVCC, $CUDA_HOME/bin/nvcc, PATH and .venv/).\n\
         Run scripts/install-cuda-tools.sh to install CUDA 13.0's nvcc into .venv/, \
         or set NVCC to an nvcc of CUDA 13.0."
            .to_string(),
    )
}

/// The nvcc of NVIDIA's PyPI wheels, as installed by
/// `scripts/install-cuda-tools.sh`:
/// `.venv/lib/python3.X/site-packages/nvidia/cu13/bin/nvcc`. The wheels lay
/// the tool chain out like a CUDA toolkit (bin/, nvvm/, include/, lib/) and
/// ship an `nvcc.profile` that points nvcc at cicc, libdevice and the
/// headers (cccl included) relative to itself, so this nvcc needs no extra
/// flags or environment.
fn venv_nvcc(manifest_dir: &Path) -> Option<PathBuf> {
    venv_site_dir(manifest_dir, "nvidia/cu13/bin", "nvcc").map(|bin| bin.join("nvcc"))
}

/// The first `.venv/lib/python3.X/site-packages/<relative>` that holds
/// `marker` (wheels that `scripts/install-cuda-tools.sh` installed).
fn venv_site_dir(manifest_dir: &Path, relative: &str, marker: &str) -> Option<PathBuf> {
    let lib = manifest_dir.join(".venv/lib");
    std::fs::read_dir(lib)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join("site-packages").join(relative))
        .find(|dir| dir.join(marker).is_file())
}

/// The CUTLASS/CuTe include directory: `EP_CUTLASS_INCLUDE`, or the
/// `nvidia-cutlass` wheel's headers in `.venv/`
/// (`.venv/lib/python3.X/site-packages/cutlass_library/source/include`).
fn find_cutlass(manifest_dir: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("EP_CUTLASS_INCLUDE") {
        return Ok(PathBuf::from(dir));
    }
    venv_site_dir(
        manifest_dir,
        "cutlass_library/source/include",
        "cute/tensor.hpp",
    )
    .ok_or_else(|| {
        "no CUTLASS headers found (tried $EP_CUTLASS_INCLUDE and .venv/).\n\
             Run scripts/install-cuda-tools.sh to install the nvidia-cutlass wheel into .venv/, \
             or set EP_CUTLASS_INCLUDE to the directory holding cute/ and cutlass/."
            .to_string()
    })
}

/// NCCL's include directory: `EP_NCCL_INCLUDE`, else the pinned wheel's in
/// `.venv/lib/python3.X/site-packages/nvidia/nccl/include`.
fn find_nccl_include(manifest_dir: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("EP_NCCL_INCLUDE") {
        let dir = PathBuf::from(dir);
        return if dir.join("nccl_device.h").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "EP_NCCL_INCLUDE={}: no nccl_device.h there",
                dir.display()
            ))
        };
    }
    venv_site_dir(manifest_dir, "nvidia/nccl/include", "nccl_device.h").ok_or_else(|| {
        "no NCCL headers found (tried $EP_NCCL_INCLUDE and .venv/).\n\
         Run scripts/install-cuda-tools.sh to install the pinned NCCL wheel \
         (nvidia-nccl-cu13) into .venv/, or set EP_NCCL_INCLUDE."
            .to_string()
    })
}

/// `NCCL_VERSION_CODE` of the headers in `include` (e.g. 22809 for 2.28.9).
fn nccl_version_code(include: &Path) -> Result<u32, String> {
    let header = include.join("nccl.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text =
        std::fs::read_to_string(&header).map_err(|e| format!("{}: {e}", header.display()))?;
    text.lines()
        .find_map(|line| {
            let rest = line.trim().strip_prefix("#define NCCL_VERSION_CODE")?;
            rest.trim().parse().ok()
        })
        .ok_or_else(|| format!("{}: no NCCL_VERSION_CODE", header.display()))
}

/// The virtual architecture of the PTX every fatbin carries for GPUs newer
/// than the SASS targets.
const PTX_ARCH: &str = "90";

/// The `sm_` targets to build SASS for: `EP_CUDA_ARCHS`, or the default.
fn target_archs(nvcc: &Path) -> Result<Vec<String>, String> {
    if let Ok(list) = env::var("EP_CUDA_ARCHS") {
        let archs: Vec<String> = list
            .split(',')
            .map(|arch| arch.trim().to_string())
            .filter(|arch| !arch.is_empty())
            .collect();
        let valid = |arch: &String| arch.bytes().all(|b| b.is_ascii_alphanumeric());
        if archs.is_empty() || !archs.iter().all(valid) {
            return Err(format!(
                "EP_CUDA_ARCHS={list:?}: expected a comma list such as 90a,100a"
            ));
        }
        return Ok(archs);
    }
    // Hopper always; Blackwell when nvcc lists it (CUDA 12.8 and later do).
    let mut archs = vec!["90a".to_string()];
    let output = Command::new(nvcc)
        .arg("--list-gpu-arch")
        .output()
        .map_err(|e| format!("could not run {}: {e}", nvcc.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} --list-gpu-arch failed ({}):\n{}",
            nvcc.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let listed = String::from_utf8_lossy(&output.stdout);
    if listed.split_whitespace().any(|arch| arch == "compute_100") {
        archs.push("100a".to_string());
    }
    Ok(archs)
}

/// Every `kernels/*.cu`, sorted so the build is reproducible.
fn cuda_sources(kernels_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries =
        std::fs::read_dir(kernels_dir).map_err(|e| format!("{}: {e}", kernels_dir.display()))?;
    let mut sources: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .filter(|path| path.extension() == Some(OsStr::new("cu")))
        .collect();
    sources.sort();
    if sources.is_empty() {
        return Err(format!("no .cu files in {}", kernels_dir.display()));
    }
    Ok(sources)
}
