//! A GEMM launch's operands (`LaunchKind::Gemm`): shapes, types and the rounded copy.

use super::common::Errors;
use super::rules::Touched;
use crate::location::Location;
use crate::types::*;

pub(super) fn gemm(
    p: &Plan,
    b: &BucketPlan,
    g: &GemmDesc,
    lat: &dyn Fn(Option<u32>, String) -> (Location, String),
    touched: &mut Touched,
    buf_touched: &mut [u64],
    e: &mut Errors,
) {
    let two_d = |shape: &[u64]| -> Option<(u64, u64)> {
        match shape {
            [r, c] => Some((*r, *c)),
            _ => None,
        }
    };
    let a = b.buffers.get(g.a as usize);
    let c = b.buffers.get(g.c as usize);
    let w = p.weights.get(g.w as usize);
    e.check(a.is_some() && c.is_some() && w.is_some(), || {
        lat(
            None,
            format!(": operand out of range (a = {}, c = {}, w = {})", g.a, g.c, g.w),
        )
    });
    let (Some(a), Some(c), Some(w)) = (a, c, w) else { return };
    let act = p.capture.dtype;
    e.check(g.a != g.c, || lat(None, ".c: the output cannot be the input".into()));
    e.check(
        g.m >= 1 && g.m <= b.rows as u64 && g.n >= 1 && g.k >= 1 && g.n < 1 << 31 && g.k < 1 << 31,
        || {
            lat(
                None,
                format!(": m×n×k = {}×{}×{} outside [1, rows]×[1, 2^31)²", g.m, g.n, g.k),
            )
        },
    );
    e.check(g.lda >= g.k && g.lda < 1 << 31, || {
        lat(None, format!(".lda: {} outside [k, 2^31) with k = {}", g.lda, g.k))
    });
    e.check(two_d(&a.shape) == Some((g.m, g.lda)) && a.dtype == act, || {
        lat(
            None,
            format!(
                ".a: {} {:?} is not {} [m, lda] = [{}, {}]",
                a.dtype.name(),
                a.shape,
                act.name(),
                g.m,
                g.lda
            ),
        )
    });
    e.check(
        two_d(&c.shape) == Some((g.m, g.n)) && (c.dtype == act || c.dtype == DType::F32),
        || {
            lat(
                None,
                format!(
                    ".c: {} {:?} is not [m, n] = [{}, {}] of {} or f32",
                    c.dtype.name(),
                    c.shape,
                    g.m,
                    g.n,
                    act.name()
                ),
            )
        },
    );
    e.check(two_d(&w.shape) == Some((g.n, g.k)) && w.dtype == act, || {
        lat(
            None,
            format!(
                ".w: {} {:?} is not {} [n, k] = [{}, {}]",
                w.dtype.name(),
                w.shape,
                act.name(),
                g.n,
                g.k
            ),
        )
    });
    touched
        .weights
        .insert(g.w, touched.weights.get(&g.w).copied().unwrap_or(0).max(w.bytes));
    buf_touched[g.a as usize] = buf_touched[g.a as usize].max(a.bytes);
    buf_touched[g.c as usize] = buf_touched[g.c as usize].max(c.bytes);
    if let Some(rid) = g.rounded {
        rounded_output(b, g, rid, c, act, lat, buf_touched, e);
    }
}

/// A GEMM's rounded copy of C (`GemmDesc.rounded`): its own `[m, n]` buffer of the
/// activation type, beside an f32 C (the copy is C's value rounded once).
#[allow(clippy::too_many_arguments)]
fn rounded_output(
    b: &BucketPlan,
    g: &GemmDesc,
    rid: u32,
    c: &crate::types::BufferDesc,
    act: DType,
    lat: &dyn Fn(Option<u32>, String) -> (Location, String),
    buf_touched: &mut [u64],
    e: &mut Errors,
) {
    let Some(r) = b.buffers.get(rid as usize) else {
        e.check(false, || lat(None, format!(".rounded: buffer {rid} out of range")));
        return;
    };
    e.check(rid != g.a && rid != g.c, || {
        lat(None, ".rounded: the rounded copy cannot be the GEMM's A or C".into())
    });
    e.check(c.dtype == DType::F32, || {
        lat(
            None,
            format!(".rounded: C is {}, and only an f32 C is rounded", c.dtype.name()),
        )
    });
    e.check(r.shape[..] == [g.m, g.n] && r.dtype == act, || {
        lat(
            None,
            format!(
                ".rounded: {} {:?} is not {} [m, n] = [{}, {}]",
                r.dtype.name(),
                r.shape,
                act.name(),
                g.m,
                g.n
            ),
        )
    });
    e.check(g.m.saturating_mul(g.n) <= u32::MAX as u64, || {
        lat(None, format!(".rounded: m×n = {}×{} elements past 2^32 - 1", g.m, g.n))
    });
    buf_touched[rid as usize] = buf_touched[rid as usize].max(r.bytes);
}
