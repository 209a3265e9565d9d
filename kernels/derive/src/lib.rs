//! `#[derive(KernelParams)]`: one declaration per kernel parameter struct.
//!
//! From a `#[repr(C)]` Rust struct whose fields are `DevPtr<T>`, `DevPtrMut<T>` (T: `i32`,
//! `i64`, `f32`, `Act`) or `u32` it generates the C declaration (emitted into the kernel's
//! NVRTC prelude, with `static_assert`s on size and alignment; offsets are asserted on the
//! Rust side), the field table (offsets, element types, access, what each pointer may name),
//! and a typed argument builder (`<Name>Ptrs<P>`, `<Name>Scalars`), so a launch that
//! misnames or forgets an argument does not compile.
//!
//! Pointer fields carry `#[arg(...)]`: `buffer`, `weight`, `table`, `k_cache`, `v_cache`,
//! `layout`, `status`, `counters`, `caller`, `scratch` (what the pointer may name),
//! `input = "name"` (it must be that input buffer), `rw` (a `DevPtrMut` the kernel also
//! reads), `local` (a `DevPtrMut` the launch writes and then reads back: a workspace its
//! CTAs exchange).

mod kernel_params;

use proc_macro::TokenStream;

/// Derives `specplan_kernels::abi::KernelParams`; see the crate docs.
#[proc_macro_derive(KernelParams, attributes(arg))]
pub fn derive_kernel_params(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    kernel_params::expand(&input)
        .unwrap_or_else(|e| e.to_compile_error())
        .into()
}
