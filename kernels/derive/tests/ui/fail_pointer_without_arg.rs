use specplan_kernels::abi::{Act, DevPtr};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct Params {
    pub x: DevPtr<Act>,
    pub rows: u32,
}

fn main() {}
