// The two macros behind `src/abi/defs.rs`, and the C spelling of the Rust
// types they accept. This file is `include!`d twice: by `src/abi/mod.rs`
// into the library, and by `build.rs`, which calls `c_header()` to write
// `ep_abi.h` for the kernels. So it holds items only (no `//!` docs, no
// `crate::` paths).

/// A type that may appear in a kernel-parameter struct, and its C spelling
/// in `ep_abi.h`: `C_NAME` before the field's name, `C_SUFFIX` after it (an
/// array's extent). Device pointers are `u64` on the Rust side and name
/// their C pointer type explicitly (`x: u64 => "const int*"`). Structs of
/// `abi_struct!` are types too, so one struct may hold another.
pub trait AbiType {
    const C_NAME: &'static str;
    const C_SUFFIX: &'static str = "";
}

impl AbiType for i32 {
    const C_NAME: &'static str = "int32_t";
}
impl AbiType for u32 {
    const C_NAME: &'static str = "uint32_t";
}
impl AbiType for i64 {
    const C_NAME: &'static str = "int64_t";
}
impl AbiType for u64 {
    const C_NAME: &'static str = "uint64_t";
}
impl AbiType for f32 {
    const C_NAME: &'static str = "float";
}
/// 128 opaque bytes (a TMA descriptor's).
impl AbiType for [u64; 16] {
    const C_NAME: &'static str = "uint64_t";
    const C_SUFFIX: &'static str = "[16]";
}

/// The C type of a field: the explicit spelling when one is given, else the
/// Rust type's [`AbiType::C_NAME`].
macro_rules! abi_c_type {
    ($t:ty) => {
        <$t as AbiType>::C_NAME
    };
    ($t:ty, $c:literal) => {
        $c
    };
}

/// Appends `///` doc lines as `//` comments, indented by `indent`.
fn push_docs(out: &mut String, indent: &str, docs: &[&str]) {
    for line in docs {
        out.push_str(indent);
        out.push_str("//");
        out.push_str(line);
        out.push('\n');
    }
}

/// Defines a struct shared by the runtime and the kernels: the `#[repr(C)]`
/// Rust struct, and `c_definition()`, its C declaration followed by
/// `static_assert`s of its size and of every field's offset, so a C side
/// that compiles is laid out exactly like the Rust side.
///
/// ```ignore
/// abi_struct! {
///     /// Docs (copied into the C header).
///     pub struct Name as "CName" {      // `as "CName"`: optional C name
///         /// Docs.
///         x: u64 => "const int*",       // a device pointer
///         n: i32,                       // a scalar
///     }
/// }
/// ```
///
/// `pub struct Name as "CName" align 128 { .. }` also aligns the struct (in
/// both languages) to 128 bytes.
macro_rules! abi_struct {
    (
        $(#[doc = $doc:literal])*
        pub struct $name:ident $(as $c_name:literal)? align $align:literal {
            $($body:tt)*
        }
    ) => {
        abi_struct!(@define [$($doc)*] $name [$($c_name)?] [repr(C, align($align))]
                    [concat!("alignas(", $align, ") ")] { $($body)* });
    };
    (
        $(#[doc = $doc:literal])*
        pub struct $name:ident $(as $c_name:literal)? {
            $($body:tt)*
        }
    ) => {
        abi_struct!(@define [$($doc)*] $name [$($c_name)?] [repr(C)] [""] { $($body)* });
    };
    (
        @define [$($doc:literal)*] $name:ident [$($c_name:literal)?] [$repr:meta] [$c_align:expr] {
            $(
                $(#[doc = $field_doc:literal])*
                $field:ident : $t:ty $(=> $c:literal)?
            ),* $(,)?
        }
    ) => {
        $(#[doc = $doc])*
        #[$repr]
        #[derive(Debug, Default, Clone, Copy, PartialEq)]
        pub struct $name {
            $(
                $(#[doc = $field_doc])*
                pub $field: $t,
            )*
        }

        impl AbiType for $name {
            const C_NAME: &'static str = abi_struct!(@name $name $($c_name)?);
        }

        impl $name {
            /// The struct's name in C.
            pub const C_NAME: &'static str = abi_struct!(@name $name $($c_name)?);

            /// The C declaration, then its size and offset asserts.
            pub fn c_definition() -> String {
                let name = Self::C_NAME;
                let mut out = String::new();
                push_docs(&mut out, "", &[$($doc),*]);
                out.push_str(&format!("struct {}{name} {{\n", $c_align));
                $(
                    push_docs(&mut out, "    ", &[$($field_doc),*]);
                    out.push_str(&format!(
                        "    {} {}{};\n",
                        abi_c_type!($t $(, $c)?),
                        stringify!($field),
                        <$t as AbiType>::C_SUFFIX
                    ));
                )*
                out.push_str("};\n");
                out.push_str(&format!(
                    "static_assert(sizeof({name}) == {}, \"{name}: size differs from src/abi/defs.rs\");\n",
                    std::mem::size_of::<Self>()
                ));
                $(
                    out.push_str(&format!(
                        "static_assert(offsetof({name}, {field}) == {}, \"{name}.{field}: offset differs from src/abi/defs.rs\");\n",
                        std::mem::offset_of!(Self, $field),
                        field = stringify!($field)
                    ));
                )*
                out
            }
        }
    };
    (@name $name:ident) => { stringify!($name) };
    (@name $name:ident $c_name:literal) => { $c_name };
}

/// How a constant's value is written in C: integers as they are, an `f32`
/// as a float literal (`448.0f`, not the double `448`), printed so that it
/// reads back as the same `f32`.
pub trait CLiteral {
    fn c_literal(&self) -> String;
}

macro_rules! integer_c_literal {
    ($($t:ty),*) => {
        $(impl CLiteral for $t {
            fn c_literal(&self) -> String {
                self.to_string()
            }
        })*
    };
}
integer_c_literal!(usize, u32, i32);

impl CLiteral for f32 {
    fn c_literal(&self) -> String {
        // `{:?}` always has a decimal point or an exponent, and is the
        // shortest text that reads back as this value.
        format!("{self:?}f")
    }
}

/// Defines constants shared by the runtime and the kernels: `pub const`s in
/// Rust and `c_constants()`, the same values as `#define EP_<NAME> <value>`
/// lines (each after its doc comment; see [`CLiteral`]).
macro_rules! abi_consts {
    (
        $(
            $(#[doc = $doc:literal])*
            $name:ident : $t:ty = $value:expr;
        )*
    ) => {
        $(
            $(#[doc = $doc])*
            pub const $name: $t = $value;
        )*

        /// The constants as C `#define`s.
        pub fn c_constants() -> String {
            let mut out = String::new();
            $(
                push_docs(&mut out, "", &[$($doc),*]);
                out.push_str(&format!(
                    "#define EP_{} {}\n",
                    stringify!($name),
                    CLiteral::c_literal(&$name)
                ));
            )*
            out
        }
    };
}
