//! A plan GEMM on the CPU (`LaunchKind::Gemm`): f64 dot products, the fp32 result as the
//! libraries write it, and the rounded copy (`GemmDesc.rounded`).

use specplan_format::GemmDesc;

use super::{Ctx, KvStore, WeightData, R};

impl<K: KvStore> Ctx<'_, K> {
    pub(super) fn gemm(&mut self, g: &GemmDesc) -> R<()> {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (a, c, w) = (g.a as usize, g.c as usize, g.w as usize);
        let Some(WeightData::F32(wv)) = self.weights.get(w) else {
            return Err(format!("GEMM weight {w} is not a float weight"));
        };
        if wv.len() < n * k {
            return Err(format!("GEMM weight {w} holds {} of n·k = {} values", wv.len(), n * k));
        }
        let lda = g.lda as usize;
        let a_rows: Vec<f64> = (0..m * k)
            .map(|i| self.ld(a, (i / k) * lda + i % k))
            .collect::<R<_>>()?;
        // Output columns split across threads: the big heads' GEMMs would otherwise make
        // the oracle the slowest part of a GPU check.
        let threads = std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(n.div_ceil(64))
            .max(1);
        let per = n.div_ceil(threads);
        let parts: Vec<Option<Vec<f64>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (a_rows, wv) = (&a_rows, &wv);
                    s.spawn(move || {
                        let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
                        let mut part = vec![0f64; m * (hi - lo)];
                        for r in 0..m {
                            let ar = &a_rows[r * k..(r + 1) * k];
                            for col in lo..hi {
                                let wr = &wv[col * k..(col + 1) * k];
                                part[r * (hi - lo) + col - lo] = ar.iter().zip(wr).map(|(x, y)| x * *y as f64).sum();
                            }
                        }
                        part
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().ok()).collect()
        });
        for (t, part) in parts.into_iter().enumerate() {
            let part = part.ok_or("a GEMM worker thread failed")?;
            let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
            for r in 0..m {
                for col in lo..hi {
                    let i = r * n + col;
                    let prev = if g.accumulate { self.ld(c, i)? } else { 0.0 };
                    // fp32 result, as cuBLAS writes it before the output cast.
                    self.st(c, i, (prev + part[r * (hi - lo) + col - lo]) as f32 as f64)?;
                }
            }
        }
        // The rounded copy (`GemmDesc.rounded`): C's new values as `cast_rows` would round
        // them (the store rounds into the copy's activation type).
        if let Some(r) = g.rounded {
            for i in 0..m * n {
                let v = self.ld(c, i)?;
                self.st(r as usize, i, v)?;
            }
        }
        Ok(())
    }
}
