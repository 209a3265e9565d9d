use specplan_kernels::abi::{Act, DevPtr, DevPtrMut, FieldKind, KernelParams, Slot};
use specplan_kernel_derive::KernelParams;

#[derive(KernelParams)]
#[repr(C)]
pub struct ExampleParams {
    pub rows: u32,
    #[arg(buffer)]
    pub x: DevPtr<Act>,
    #[arg(weight, buffer)]
    pub ids: DevPtr<i64>,
    #[arg(buffer, rw)]
    pub out: DevPtrMut<f32>,
    pub n: u32,
}

fn main() {
    // rows at 0, then 4 bytes of padding before the first pointer, as in C.
    assert_eq!(ExampleParams::SIZE, 40);
    assert_eq!(ExampleParams::FIELDS[1].offset, 8);
    assert!(ExampleParams::C_DECL.contains("const act_t* x;"));
    assert!(ExampleParams::C_DECL.contains("static_assert(sizeof(ExampleParams) == 40"));
    let FieldKind::Ptr(p) = ExampleParams::FIELDS[3].kind else { panic!("out is a pointer") };
    assert!(p.access.reads() && p.access.writes());
    // The typed builder: every argument by name, in field order once assembled.
    let args = ExampleParams::assemble(ExamplePtrs { x: 'x', ids: 'i', out: 'o' }, ExampleScalars { rows: 3, n: 7 });
    assert_eq!(args, vec![Slot::U32(3), Slot::Ptr('x'), Slot::Ptr('i'), Slot::Ptr('o'), Slot::U32(7)]);
    let (p, s) = ExampleParams::split(&args).expect("round trip");
    assert_eq!((p.x, p.ids, p.out, s.rows, s.n), ('x', 'i', 'o', 3, 7));
    assert!(ExampleParams::split(&args[1..]).is_none(), "a short list does not split");
}
