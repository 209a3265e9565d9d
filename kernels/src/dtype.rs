//! Element types a plan names. Activations and weights are `Bf16` or `F16`.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum DType {
    Bf16,
    F16,
    F32,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Whether this is an activation type (bf16 or f16).
    pub fn is_act(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16)
    }

    /// The C type of an element of this dtype as a kernel holds it (`float` for f32).
    pub fn c_elem(self) -> &'static str {
        match self {
            DType::F32 => "float",
            d => d.c_act(),
        }
    }

    /// The C type of an activation dtype (`act_t`).
    pub fn c_act(self) -> &'static str {
        match self {
            DType::F16 => "__half",
            _ => "__nv_bfloat16",
        }
    }
}
