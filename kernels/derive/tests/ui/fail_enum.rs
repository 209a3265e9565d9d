use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub enum NotAStruct {
    A,
}

fn main() {}
