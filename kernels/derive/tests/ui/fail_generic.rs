use specplan_kernels::abi::DevPtr;
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct GenericParams<T> {
    #[arg(buffer)]
    pub x: DevPtr<T>,
}

fn main() {}
