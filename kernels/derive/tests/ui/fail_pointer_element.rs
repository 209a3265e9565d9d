use specplan_kernels::abi::DevPtr;
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct BadElemParams {
    #[arg(buffer)]
    pub bytes: DevPtr<u8>,
}

fn main() {}
