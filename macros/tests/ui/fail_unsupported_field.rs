use specplan_kernels::abi::{Act, DevPtr};
use specplan_macros::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct BadFieldParams {
    pub x: DevPtr<Act>,
    pub name: String,
    pub scale: f64,
}

fn main() {}
