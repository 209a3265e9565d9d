use specplan_kernels::abi::{Act, DevPtr};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct TupleParams(pub DevPtr<Act>, pub u32);

fn main() {}
