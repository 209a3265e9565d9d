use specplan_kernels::abi::DevPtr;
use specplan_macros::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct BadElemParams {
    pub bytes: DevPtr<u8>,
}

fn main() {}
