//! A step must not report success with non-finite outputs: the check `run_cpu` and
//! `run_gpu` make before anything is written.

use specplan_format::{io, ValidatedPlan};

use super::{ContractError, StepResult};

impl StepResult {
    /// The first request whose outputs are not finite (the hidden state as the plan's
    /// activation type holds it, the top-K probabilities, the logits), named with the
    /// tensor: a step must not report success with them.
    pub fn check_finite(&self, plan: &ValidatedPlan, b: usize) -> Result<(), ContractError> {
        let o = &self.outputs;
        let h = plan.model.hidden as usize;
        let act = plan.capture.dtype;
        for i in 0..b {
            let row = |v: &[f32]| {
                let w = v.len() / b.max(1);
                v[i * w..(i + 1) * w].to_vec()
            };
            let bad = |tensor: &str, message: String| ContractError::NonFinite {
                tensor: tensor.into(),
                request: i,
                message,
            };
            if let Some((j, m)) = specplan_runtime::step::first_non_finite(&o.hidden_out[i * h..(i + 1) * h], act) {
                return Err(bad(io::HIDDEN_OUT, format!("element {j}: {m}")));
            }
            for (name, v) in [(io::TOPK_PROBS, &o.topk_probs), (io::LOGITS, &o.logits)] {
                if let Some(j) = row(v).iter().position(|x| !x.is_finite()) {
                    return Err(bad(name, format!("element {j} is {}", row(v)[j])));
                }
            }
        }
        Ok(())
    }
}
