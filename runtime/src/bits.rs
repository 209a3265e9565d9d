//! Activation bits on the host: f32 values as bf16/f16 bit patterns and back, and plain
//! integer slices as the bytes the device reads.

use specplan_format::DType;

/// f32 values as the activation type's raw bits (round to nearest even).
pub fn to_act_bits(v: &[f32], act: DType) -> Vec<u16> {
    match act {
        DType::F16 => v.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect(),
        _ => v.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect(),
    }
}

/// One activation value's raw bits as f32 (exact).
pub fn from_act_bits(u: u16, act: DType) -> f32 {
    match act {
        DType::F16 => half::f16::from_bits(u).to_f32(),
        _ => half::bf16::from_bits(u).to_f32(),
    }
}

/// f32 values as little-endian activation bytes.
pub fn to_act_bytes(v: &[f32], act: DType) -> Vec<u8> {
    to_act_bits(v, act).iter().flat_map(|u| u.to_le_bytes()).collect()
}

/// A value rounded to the activation type (as f32).
pub fn round_act(x: f32, act: DType) -> f32 {
    from_act_bits(to_act_bits(&[x], act)[0], act)
}

/// The bytes of a slice of plain integers, as the device reads them (little-endian hosts).
pub fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "the staging copies assume a little-endian host"
    );
    // SAFETY: T is a plain integer type here (i64, i32, u16): every byte is initialized and
    // any alignment is valid for u8; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
