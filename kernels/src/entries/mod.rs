//! One module per template: its entries' parameter structs, the [`Kernel`] declarations
//! (threads, shared memory, grid, `u32` arguments, extents) and the template's constants.
//! The kernel bodies (`kernels/cuda/*.cu`) document the same contracts in their headers.
//!
//! [`Kernel`]: crate::abi::Kernel

pub mod attention;
pub mod embed;
pub mod gemm;
pub mod io;
pub mod io_decode;
pub mod mlp;
pub mod norm;
pub mod rope;
pub mod sample;
pub mod select;
pub mod tree;

use crate::facts::KernelFacts;
use crate::source::ConstValue;

/// `act_t`, first in every prelude.
pub(crate) fn act(f: &KernelFacts) -> (String, ConstValue) {
    ("act_t".into(), ConstValue::Type(f.act.c_act().into()))
}

/// `stream_t`, the residual stream's element type (`KernelFacts::stream`), in the templates
/// whose entries read or write the stream.
pub(crate) fn stream(f: &KernelFacts) -> (String, ConstValue) {
    ("stream_t".into(), ConstValue::Type(f.stream.c_elem().into()))
}

pub(crate) fn u(name: &str, v: u32) -> (String, ConstValue) {
    (name.into(), ConstValue::U32(v))
}
