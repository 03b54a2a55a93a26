//! The ABI between the runtime and the CUDA kernels: every kernel-parameter
//! struct and every constant both sides use, defined once in `defs.rs`.
//!
//! `build.rs` includes the same two files and writes `ep_abi.h` from them
//! (`c_header`), with a `static_assert` on the size of every struct and the
//! offset of every field; every kernel includes that header. A field added,
//! removed or reordered here therefore changes both sides at once, and a
//! kernel that still spells the old layout fails to compile. To read the
//! generated header: `find target -name ep_abi.h`.

include!("gen.rs");
include!("defs.rs");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_declares_every_struct_with_its_asserts() {
        let header = c_header();
        for name in [
            "EpDeviceStatus",
            "DispatchParams",
            "CombineParams",
            "LlParams",
        ] {
            assert!(header.contains(&format!("struct {name} {{")), "{name}");
            assert!(header.contains(&format!("static_assert(sizeof({name}) ==")));
        }
        assert!(header.contains("#define EP_MAX_TOPK 16\n"));
        assert!(header.contains("static_assert(offsetof(LlParams, do_recv) =="));
        assert!(header.contains("    const int* topk_idx;\n"));
    }

    #[test]
    fn layouts_are_the_c_layouts() {
        assert_eq!(std::mem::size_of::<DeviceStatus>(), 24);
        assert_eq!(std::mem::size_of::<LlCounters>(), 24);
        assert_eq!(std::mem::offset_of!(LlParams, area), 14 * 8);
    }
}
