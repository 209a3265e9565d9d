use specplan_macros::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub enum NotAStruct {
    A,
}

fn main() {}
