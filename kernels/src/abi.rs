//! The kernel-argument ABI shared by Rust and CUDA C.
//!
//! A kernel takes one parameter struct by value. Its Rust declaration (in `params.rs`,
//! with `#[derive(KernelParams)]`) is the single source of truth: the derive generates the
//! C declaration that the compiler puts into the kernel's prelude (with `static_assert`s
//! on size, alignment and offsets), and the field table that orders a launch's arguments
//! and places each at its offset when the runtime packs the struct.

use std::marker::PhantomData;

/// The plan's activation element type (`act_t` in C: bf16 or f16).
pub struct Act;

/// A device pointer the kernel reads (`const T*` in C).
#[repr(transparent)]
pub struct DevPtr<T>(pub u64, PhantomData<*const T>);

/// A device pointer the kernel writes (`T*` in C).
#[repr(transparent)]
pub struct DevPtrMut<T>(pub u64, PhantomData<*mut T>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// An 8-byte device address.
    Ptr,
    /// A 4-byte unsigned integer.
    U32,
}

/// One field of a parameter struct, at its C offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub kind: FieldKind,
    pub offset: u32,
    /// A `DevPtrMut` (the kernel may write through it).
    pub writes: bool,
}

/// Implemented by `#[derive(KernelParams)]`.
pub trait KernelParams {
    const C_NAME: &'static str;
    /// `struct NAME { ... };` plus the layout `static_assert`s.
    const C_DECL: &'static str;
    const SIZE: u32;
    const ALIGN: u32;
    const FIELDS: &'static [Field];
}

/// The ABI of one kernel entry, as plain data.
#[derive(Clone, Copy, Debug)]
pub struct ParamsInfo {
    pub c_name: &'static str,
    pub c_decl: &'static str,
    pub size: u32,
    pub fields: &'static [Field],
}

impl ParamsInfo {
    pub fn of<P: KernelParams>() -> ParamsInfo {
        ParamsInfo {
            c_name: P::C_NAME,
            c_decl: P::C_DECL,
            size: P::SIZE,
            fields: P::FIELDS,
        }
    }
}
