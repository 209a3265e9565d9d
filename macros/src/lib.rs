//! specplan's kernel-ABI macro.
//!
//! `#[derive(KernelParams)]`: one source of truth for a kernel's parameter struct. From a
//! `#[repr(C)]` Rust struct it generates the C declaration (emitted into the kernel's NVRTC
//! prelude, with `static_assert`s on size and alignment; offsets are asserted on the Rust side) and the field table
//! the launch packing uses, and asserts on the Rust side that rustc's layout is the one the
//! C side will see.
//!
//! `include_plan!` lives in `macros/plan` (crate `specplan-plan-macros`): it needs the
//! compiler, and the compiler needs this derive, so the two cannot share a crate.

mod kernel_params;

use proc_macro::TokenStream;

/// Derives `specplan_kernels::abi::KernelParams` for a `#[repr(C)]` struct whose fields are
/// `DevPtr<T>`, `DevPtrMut<T>` (T: `i32`, `i64`, `f32`, `Act`) or `u32`.
#[proc_macro_derive(KernelParams)]
pub fn derive_kernel_params(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    kernel_params::expand(&input)
        .unwrap_or_else(|e| e.to_compile_error())
        .into()
}
