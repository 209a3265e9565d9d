use specplan_kernels::abi::{Act, DevPtr, DevPtrMut, KernelParams};
use specplan_macros::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct ExampleParams {
    pub rows: u32,
    pub x: DevPtr<Act>,
    pub ids: DevPtr<i64>,
    pub out: DevPtrMut<f32>,
    pub n: u32,
}

fn main() {
    // rows at 0, then 4 bytes of padding before the first pointer, as in C.
    assert_eq!(ExampleParams::SIZE, 40);
    assert_eq!(ExampleParams::FIELDS[1].offset, 8);
    assert!(ExampleParams::C_DECL.contains("const act_t* x;"));
    assert!(ExampleParams::C_DECL.contains("static_assert(sizeof(ExampleParams) == 40"));
}
