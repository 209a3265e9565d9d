use specplan_kernels::abi::{Act, DevPtr};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct BadFieldParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    pub name: String,
    pub scale: f64,
}

fn main() {}
