use specplan_kernels::abi::DevPtr;
use specplan_macros::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct GenericParams<T> {
    pub x: DevPtr<T>,
}

fn main() {}
