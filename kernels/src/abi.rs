//! The kernel-argument ABI shared by Rust and CUDA C.
//!
//! A kernel takes one parameter struct by value. Its Rust declaration (in `entries/`, with
//! `#[derive(KernelParams)]`) is the single source of truth: the derive generates the C
//! declaration the compiler puts into the kernel's prelude (with `static_assert`s on size
//! and alignment), the field table that orders a launch's arguments and places each at its
//! offset when the runtime packs the struct, and typed argument builders. [`Kernel`] adds
//! what the entry's code assumes about its launch (threads, shared memory, grid, the `u32`
//! arguments) and how many elements each pointer argument touches.

use std::marker::PhantomData;

use crate::facts::{BucketFacts, KernelFacts};
use crate::{DType, Entry};

/// The plan's activation element type (`act_t` in C: bf16 or f16).
pub struct Act;

/// The residual stream's element type of the instance (`stream_t` in C: f32 in an
/// unsharded draft-extend phase, else `act_t`; `KernelFacts::stream`).
pub struct Stream;

/// A device pointer the kernel reads (`const T*` in C).
#[repr(transparent)]
pub struct DevPtr<T>(pub u64, PhantomData<*const T>);

/// A device pointer the kernel writes (`T*` in C).
#[repr(transparent)]
pub struct DevPtrMut<T>(pub u64, PhantomData<*mut T>);

/// Element type of a pointer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    I32,
    I64,
    F32,
    /// The plan's activation type.
    Act,
    /// The instance's residual stream type (`KernelFacts::stream`).
    Stream,
}

impl Elem {
    /// The element's dtype in an instance specialized for `f`.
    pub fn dtype(self, f: &KernelFacts) -> DType {
        match self {
            Elem::I32 => DType::I32,
            Elem::I64 => DType::I64,
            Elem::F32 => DType::F32,
            Elem::Act => f.act,
            Elem::Stream => f.stream,
        }
    }
}

/// How a kernel uses the memory behind a pointer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
    /// Written, then read back by the same launch (`#[arg(local)]`: a workspace whose bytes
    /// only that launch's CTAs exchange, such as `topk_fused`'s chunk records). Nothing from
    /// before the launch is read, and nothing after it needs the bytes.
    WriteRead,
}

impl Access {
    /// Whether the launch reads the memory at all (its own writes included).
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite | Access::WriteRead)
    }
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite | Access::WriteRead)
    }
    /// Whether the launch reads what was there before it.
    pub fn reads_before(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
}

/// What a pointer argument may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowed {
    /// An arena buffer of the bucket.
    pub buffer: bool,
    /// A weight of the weight region.
    pub weight: bool,
    /// The page table.
    pub table: bool,
    /// A layer's K pool.
    pub k_cache: bool,
    /// A layer's V pool.
    pub v_cache: bool,
    /// The registered K/V layout words (`kv.rs`).
    pub layout: bool,
    /// The runtime's step status words (`kv.rs`); runtime-launched entries only.
    pub status: bool,
    /// The runtime's arrival counters (`kv.rs`, [`crate::kv::COUNTER_WORDS`] u32 words, zero
    /// at load; every launch that counts leaves them zero again).
    pub counters: bool,
    /// A caller's device tensor, set per step; runtime-launched entries only.
    pub caller: bool,
    /// Runtime memory outside the plan's regions (a GEMM library's workspace);
    /// runtime-launched entries only.
    pub scratch: bool,
}

/// A pointer field of a parameter struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtrField {
    pub elem: Elem,
    pub access: Access,
    pub allowed: Allowed,
    /// The named input buffer this argument must be (`io::*`), if any.
    pub input: Option<&'static str>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// An 8-byte device address.
    Ptr(PtrField),
    /// A 4-byte unsigned integer.
    U32,
}

/// One field of a parameter struct, at its C offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: u32,
    pub kind: FieldKind,
}

impl Field {
    pub fn size(&self) -> u32 {
        match self.kind {
            FieldKind::Ptr(_) => 8,
            FieldKind::U32 => 4,
        }
    }
}

/// One launch argument in field order: a pointer (of whatever representation the caller
/// uses: a plan argument, a device address, a CPU-executor location) or a `u32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot<P> {
    Ptr(P),
    U32(u32),
}

/// What a launch touches through one pointer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// At least this many elements of the field's element type.
    Elems(u64),
    /// Nothing: the argument must be null.
    Unused,
}

/// Implemented by `#[derive(KernelParams)]`.
pub trait KernelParams {
    const C_NAME: &'static str;
    /// `struct NAME { ... };` plus the layout `static_assert`s.
    const C_DECL: &'static str;
    const SIZE: u32;
    const ALIGN: u32;
    const FIELDS: &'static [Field];
    /// The pointer arguments, one `P` each, by name.
    type Ptrs<P>;
    /// The `u32` arguments, by name.
    type Scalars: Copy;
    /// The argument list in field order.
    fn assemble<P>(p: Self::Ptrs<P>, s: Self::Scalars) -> Vec<Slot<P>>;
    /// The typed arguments of a list in field order; `None` when the list's length or kinds
    /// differ from the struct.
    fn split<P: Clone>(slots: &[Slot<P>]) -> Option<(Self::Ptrs<P>, Self::Scalars)>;
    /// The pointers in field order.
    fn ptr_list<P>(p: Self::Ptrs<P>) -> Vec<P>;
}

/// One kernel entry point: its parameter struct plus what its code assumes about a launch.
/// Block shape is always `(threads, 1, 1)`.
pub trait Kernel: KernelParams {
    const ENTRY: Entry;
    /// Threads per block; the prelude declares it (`<ENTRY>_THREADS`) and the entry's
    /// `__launch_bounds__` and loops use it.
    fn threads(f: &KernelFacts) -> u32;
    /// Dynamic shared memory the code indexes, in bytes.
    fn smem(_f: &KernelFacts) -> u64 {
        0
    }
    /// Grid and `u32` arguments of this entry's launch in a bucket.
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], Self::Scalars);
    /// CTAs per thread block cluster, along the grid's z (1: no cluster; sm_90+ only).
    fn cluster(_b: &BucketFacts, _f: &KernelFacts) -> u32 {
        1
    }
    /// Elements each pointer argument touches for these `u32` arguments.
    fn extents(s: &Self::Scalars, f: &KernelFacts) -> Self::Ptrs<Extent>;
}

/// The ABI of one entry, as plain data.
#[derive(Clone, Copy, Debug)]
pub struct Abi {
    pub c_name: &'static str,
    pub c_decl: &'static str,
    pub size: u32,
    pub fields: &'static [Field],
}

impl Abi {
    pub fn of<P: KernelParams>() -> Abi {
        Abi {
            c_name: P::C_NAME,
            c_decl: P::C_DECL,
            size: P::SIZE,
            fields: P::FIELDS,
        }
    }
}

/// What a launch of an entry in a bucket must look like, field by field.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchShape {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem: u64,
    /// CTAs per cluster along z (1: none).
    pub cluster: u32,
    /// Per field, in order: the extent of a pointer or the value of a `u32`.
    pub args: Vec<Slot<Extent>>,
}

/// The shape of a launch of `K`, from its typed declaration.
pub fn shape_of<K: Kernel>(b: &BucketFacts, f: &KernelFacts) -> LaunchShape {
    let (grid, scalars) = K::launch(b, f);
    LaunchShape {
        grid,
        block: [K::threads(f), 1, 1],
        smem: K::smem(f),
        cluster: K::cluster(b, f),
        args: K::assemble(K::extents(&scalars, f), scalars),
    }
}
