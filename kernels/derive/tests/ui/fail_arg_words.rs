use specplan_kernels::abi::{Act, DevPtr, DevPtrMut};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct Params {
    #[arg(bufer)]
    pub x: DevPtr<Act>,
    #[arg(buffer, rw)]
    pub y: DevPtr<Act>,
    #[arg(buffer, local)]
    pub z: DevPtr<Act>,
    #[arg(buffer, rw, local)]
    pub w: DevPtrMut<Act>,
    #[arg(buffer)]
    pub rows: u32,
}

fn main() {}
