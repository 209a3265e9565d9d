//! How GPU results are compared with the references, as tested functions (the bounds the
//! checks use are stated where they call these).

/// Relative RMS error of `got` against `want`: ‖got − want‖ / ‖want‖ (f64 sums). A
/// non-finite value anywhere gives infinity.
pub fn rel_rms(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() || !w.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w).powi(2);
        den += w.powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Whether a probability is within `rel·p + abs` of the reference's.
pub fn prob_close(got: f64, want: f64, rel: f64, abs: f64) -> bool {
    got.is_finite() && (got - want).abs() <= rel * want + abs
}

/// Top-K slots of one request whose ids differ where the reference has no near tie: slot
/// s is a tie when its reference probability is within `tie` of a neighbour's (for the
/// last slot, whose rival is the (K+1)-th candidate the reference does not list, when the
/// GPU's probability is within `tie` of the reference's). Returns the mismatched slots.
pub fn id_mismatches(got_ids: &[i64], want_ids: &[i64], got_p: &[f32], want_p: &[f32], tie: f64) -> Vec<usize> {
    let k = want_ids.len();
    (0..k)
        .filter(|&s| {
            let w = want_p[s] as f64;
            let prev = if s > 0 { want_p[s - 1] as f64 - w } else { 1.0 };
            let next = if s + 1 < k {
                w - want_p[s + 1] as f64
            } else if (got_p[s] as f64 - w).abs() <= tie {
                0.0
            } else {
                1.0
            };
            prev > tie && next > tie && got_ids[s] != want_ids[s]
        })
        .collect()
}

/// Elements that differ bit for bit.
pub fn bit_diffs<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// f32 slices compared by their bits.
pub fn f32_bit_diffs(a: &[f32], b: &[f32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count() + a.len().abs_diff(b.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_rms_is_relative_and_catches_nan() {
        assert_eq!(rel_rms(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        let e = rel_rms(&[1.1, 2.0], &[1.0, 2.0]);
        assert!((e - 0.1 / 5f64.sqrt()).abs() < 1e-12);
        assert_eq!(rel_rms(&[f64::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(rel_rms(&[1.0], &[f64::INFINITY]), f64::INFINITY);
    }

    #[test]
    fn prob_close_bounds() {
        assert!(prob_close(0.5049, 0.5, 1e-2, 0.0));
        assert!(!prob_close(0.506, 0.5, 1e-2, 0.0));
        assert!(prob_close(1e-5, 0.0, 1e-2, 1e-4));
        assert!(!prob_close(f64::NAN, 0.5, 1.0, 1.0));
    }

    #[test]
    fn id_mismatches_ignore_near_ties_only() {
        let want_p = [0.5, 0.3, 0.2995, 0.1];
        let want = [10, 11, 12, 13];
        // Slots 1 and 2 are a near tie (0.0005 apart): swapping them is no mismatch.
        assert!(id_mismatches(&[10, 12, 11, 13], &want, &want_p, &want_p, 1e-3).is_empty());
        // Slot 0 has no tie: a different id there is.
        assert_eq!(id_mismatches(&[9, 11, 12, 13], &want, &want_p, &want_p, 1e-3), vec![0]);
        // The last slot: a tie when the GPU's probability is within the bound of the reference's.
        assert!(id_mismatches(&[10, 11, 12, 14], &want, &[0.5, 0.3, 0.2995, 0.1005], &want_p, 1e-3).is_empty());
        assert_eq!(
            id_mismatches(&[10, 11, 12, 14], &want, &[0.5, 0.3, 0.2995, 0.2], &want_p, 1e-3),
            vec![3]
        );
    }

    #[test]
    fn bit_diffs_count_length_differences() {
        assert_eq!(bit_diffs(&[1u16, 2, 3], &[1, 2, 4]), 1);
        assert_eq!(bit_diffs(&[1u16, 2], &[1, 2, 3]), 1);
        assert_eq!(f32_bit_diffs(&[0.0], &[-0.0]), 1);
    }
}
