use specplan_kernels::abi::{Act, DevPtr};
use specplan_macros::KernelParams;

#[derive(KernelParams)]
pub struct NoReprParams {
    pub x: DevPtr<Act>,
}

fn main() {}
