use specplan_kernels::abi::{Act, DevPtr};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
pub struct NoReprParams {
    #[arg(buffer)]
    pub x: DevPtr<Act>,
}

fn main() {}
