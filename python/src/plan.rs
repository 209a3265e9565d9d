//! `Plan`: a validated plan, loaded from a file or compiled from a preset or config with the
//! CLI's flags (snake_case), and its facts.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use specplan_compiler::config::flags::{FlagValue, Kind};
use specplan_compiler::config::{self, Overrides, Source};
use specplan_compiler::jit::Jit;
use specplan_format::signature::{self, Role};
use specplan_format::{Replay, ValidatedPlan};

/// `(label, arena bytes, [(batch, arena bytes)], positions per request)` of one phase.
type PhaseMemory = (String, u64, Vec<(u32, u64)>, u64);

/// A validated draft-extend plan.
#[pyclass(module = "specplan._native", frozen)]
pub struct Plan {
    pub(crate) inner: ValidatedPlan,
    /// What the config reader noted while compiling this plan (a serving context above the
    /// head's training length, mrope read as plain RoPE, ...): the CLI's `note:` lines.
    /// Empty for a plan loaded from a file.
    pub(crate) notes: Vec<String>,
}

/// A dtype as the Python package spells it (the `dtype=` flag's spelling: "fp16", not the
/// format's "f16").
fn py_dtype(d: specplan_format::DType) -> &'static str {
    match d {
        specplan_format::DType::F16 => "fp16",
        other => other.name(),
    }
}

/// One tensor of a signature for Python: `(name, dtype, shape, role, doc)`.
type SigEntry = (&'static str, &'static str, Vec<u64>, &'static str, &'static str);

/// The keyword `Plan.compile` takes besides the flag table's (`config::FLAGS`): compile
/// without kernel binaries (for review and the CPU executor).
const NO_KERNELS: &str = "no_kernels";

/// Every keyword `Plan.compile` accepts: the flag table's Python names, then `no_kernels`.
fn keywords() -> Vec<&'static str> {
    config::FLAGS
        .iter()
        .flat_map(|f| f.python.iter().copied())
        .chain([NO_KERNELS])
        .collect()
}

fn u32_flag(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u32> {
    // A bool is an int to Python: `page_size=True` must not compile as page size 1.
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a non-negative integer below 2^32, got the bool {v}"
        )));
    }
    v.extract::<u32>()
        .map_err(|_| PyTypeError::new_err(format!("{name}: expected a non-negative integer below 2^32, got {v}")))
}

fn overrides(flags: Option<&Bound<'_, PyDict>>) -> PyResult<(Overrides, bool)> {
    let mut o = Overrides::default();
    let mut no_kernels = false;
    let Some(flags) = flags else {
        return Ok((o, no_kernels));
    };
    let mut seen: Vec<String> = Vec::new();
    for (k, v) in flags.iter() {
        let name: String = k.extract()?;
        // Aliases name one flag (`topk` and `speculative_eagle_topk`).
        let flag = config::flags::by_python(&name)
            .map_or(name.as_str(), |f| f.python[0])
            .to_string();
        let same = |s: &String| config::flags::by_python(s).map_or(s.as_str(), |f| f.python[0]) == flag;
        if let Some(prev) = seen.iter().find(|s| same(s)) {
            return Err(PyTypeError::new_err(format!(
                "{name} and {prev} are the same flag ({flag}); give it once"
            )));
        }
        seen.push(name.clone());
        if name == NO_KERNELS {
            if !v.is_instance_of::<pyo3::types::PyBool>() {
                return Err(PyTypeError::new_err(format!("{NO_KERNELS}: expected a bool, got {v}")));
            }
            no_kernels = v
                .extract::<bool>()
                .map_err(|_| PyTypeError::new_err(format!("{NO_KERNELS}: expected a bool, got {v}")))?;
            continue;
        }
        let Some(f) = config::flags::by_python(&name) else {
            let hint = config::did_you_mean(&name, &keywords());
            return Err(PyTypeError::new_err(format!(
                "Plan.compile() got an unexpected keyword argument {name:?}{hint}"
            )));
        };
        let value = match f.kind {
            Kind::U32 => FlagValue::U32(u32_flag(&name, &v)?),
            Kind::Text => FlagValue::Text(v.extract::<String>().map_err(|_| {
                PyTypeError::new_err(format!("{name}: expected a string ({}), got {v}", f.help_text()))
            })?),
            Kind::IntList => FlagValue::Text(if let Ok(s) = v.extract::<String>() {
                s
            } else if let Ok(list) = v.extract::<Vec<u32>>() {
                list.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            } else {
                return Err(PyTypeError::new_err(format!(
                    "{name}: expected a string or a list of integers ({}), got {v}",
                    f.help_text()
                )));
            }),
            Kind::TextList => FlagValue::Text(if let Ok(s) = v.extract::<String>() {
                s
            } else if let Ok(list) = v.extract::<Vec<String>>() {
                list.join(",")
            } else {
                return Err(PyTypeError::new_err(format!(
                    "{name}: expected a string or a list of strings ({}), got {v}",
                    f.help_text()
                )));
            }),
        };
        f.set(&mut o, value)
            .map_err(|m| PyTypeError::new_err(format!("{name}: {m}")))?;
    }
    Ok((o, no_kernels))
}

fn read(what: &str, path: &str) -> PyResult<String> {
    specplan_format::read_config(std::path::Path::new(path)).map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

#[pymethods]
impl Plan {
    /// Loads and validates a plan file (ValueError with the plan error on a bad file).
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Plan> {
        specplan_format::load_file(&path)
            .map(|inner| Plan {
                inner,
                notes: Vec::new(),
            })
            .map_err(|e| PyValueError::new_err(format!("cannot load plan {}: {e}", path.display())))
    }

    /// Decodes and validates a plan from bytes.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Plan> {
        specplan_format::decode(data)
            .map(|inner| Plan {
                inner,
                notes: Vec::new(),
            })
            .map_err(|e| PyValueError::new_err(format!("cannot decode plan: {e}")))
    }

    /// Compiles a plan from a preset, a TOML config or a Hugging Face config.json (exactly
    /// one), with the CLI's flags. `nvidia_dirs`: wheel folders to look for NVRTC in.
    #[staticmethod]
    #[pyo3(signature = (preset=None, config=None, hf_config=None, flags=None, nvidia_dirs=Vec::new()))]
    fn compile(
        py: Python<'_>,
        preset: Option<String>,
        config: Option<String>,
        hf_config: Option<String>,
        flags: Option<&Bound<'_, PyDict>>,
        nvidia_dirs: Vec<PathBuf>,
    ) -> PyResult<Plan> {
        let source = match (preset, config, hf_config) {
            (Some(p), None, None) => Source::Preset(p),
            (None, Some(c), None) => Source::Toml {
                text: read("config", &c)?,
                name: c,
            },
            (None, None, Some(h)) => Source::HfConfig {
                text: read("hf_config", &h)?,
                name: h,
            },
            _ => {
                return Err(PyValueError::new_err(
                    "Plan.compile needs exactly one of preset=, config= (TOML) or hf_config= (config.json)",
                ))
            }
        };
        let (o, no_kernels) = overrides(flags)?;
        let cfg = config::resolve(&source, &o).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let notes = cfg.notes.clone();
        py.detach(|| {
            let jit = if no_kernels {
                None
            } else {
                Some(Jit::discover(&nvidia_dirs).map_err(|e| PyRuntimeError::new_err(e.to_string()))?)
            };
            let target = specplan_compiler::Target::default();
            specplan_compiler::compile(&cfg, &target, jit.as_ref(), &|_, _| {})
                .map(|c| Plan { inner: c.plan, notes })
                .map_err(|e| PyValueError::new_err(e.to_string()))
        })
    }

    /// The same plan with every kernel binary compiled here from the plan's validated
    /// constants (the machine code a plan file carries is not trusted; see ARCHITECTURE.md).
    #[pyo3(signature = (nvidia_dirs=Vec::new()))]
    fn rebuild_kernels(&self, py: Python<'_>, nvidia_dirs: Vec<PathBuf>) -> PyResult<Plan> {
        let plan = self.inner.clone();
        py.detach(|| {
            let jit = Jit::discover(&nvidia_dirs).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            specplan_compiler::rebuild_kernels(&plan, &jit)
                .map(|inner| Plan {
                    inner,
                    notes: Vec::new(),
                })
                .map_err(|e| PyValueError::new_err(e.to_string()))
        })
    }

    /// Writes the plan by the CLI's output rules (`specplan_contract::output`): a
    /// new path or a regular file atomically (a temporary file renamed into place); a FIFO
    /// or a character device written through, never replaced; a symbolic link followed; a
    /// read-only file, a directory, a block device or a socket refused, nothing written.
    fn save(&self, path: PathBuf) -> PyResult<()> {
        let bytes = specplan_format::encode(&self.inner)
            .map_err(|e| PyValueError::new_err(format!("cannot encode the plan: {e}")))?;
        specplan_contract::output::write_file(&path, &bytes).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The canonical text (one fact per line), as `specplan show` prints it.
    fn text(&self) -> String {
        specplan_format::to_text(&self.inner)
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }
    #[getter]
    fn buckets(&self) -> Vec<u32> {
        self.inner.buckets().iter().map(|b| b.batch).collect()
    }
    /// Buckets replayed as CUDA graphs (the others run eagerly).
    #[getter]
    fn graph_buckets(&self) -> Vec<u32> {
        self.inner
            .buckets()
            .iter()
            .filter(|b| b.replay == Replay::Graph)
            .map(|b| b.batch)
            .collect()
    }
    #[getter]
    fn num_draft_tokens(&self) -> u32 {
        self.inner.spec.num_draft_tokens
    }
    #[getter]
    fn topk(&self) -> u32 {
        self.inner.spec.topk
    }
    /// `speculative_num_steps` of the config (the draft-decode tier SGLang runs by default).
    #[getter]
    fn num_steps(&self) -> u32 {
        self.inner.spec.num_steps
    }
    /// The config reader's notes of this compile (empty for a loaded plan).
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    /// Memory of each phase before anything runs: `(label, its largest bucket's arena (the
    /// runtime allocates one arena, the largest of all phases), [(batch, arena bytes)],
    /// positions past a prefix one step writes or reserves in the engine's table row)`.
    fn memory(&self) -> Vec<PhaseMemory> {
        let p = &self.inner;
        p.phases
            .iter()
            .map(|ph| {
                (
                    ph.kind.label(),
                    ph.arena_bytes(),
                    ph.buckets.iter().map(|b| (b.batch, b.arena_bytes)).collect(),
                    ph.positions_per_request(&p.spec, p.capture.page_size),
                )
            })
            .collect()
    }

    /// The phases the plan compiles: `(kind, rows per request, buckets)`; a draft-decode
    /// phase is named with its tier (`draft_decode:3`).
    fn phases(&self) -> Vec<(String, u32, Vec<u32>)> {
        self.inner
            .phases
            .iter()
            .map(|ph| {
                (
                    ph.kind.label(),
                    ph.rows_per_request,
                    ph.buckets.iter().map(|b| b.batch).collect(),
                )
            })
            .collect()
    }

    /// The signature of `phase` resolved at `batch` requests (`specplan_format::signature`):
    /// `(name, dtype, shape, role, doc)` per tensor the plan has, in declaration order — what
    /// the Python runner checks its arguments and sizes its outputs by.
    #[pyo3(signature = (batch=1, phase="draft_extend"))]
    fn signature(&self, batch: u32, phase: &str) -> PyResult<Vec<SigEntry>> {
        let kind = self.inner.phase_by_label(phase).ok_or_else(|| {
            PyValueError::new_err(format!("phase {phase:?}: the plan has {}", self.inner.phase_labels()))
        })?;
        Ok(signature::resolve(&self.inner, kind, batch)
            .into_iter()
            .map(|r| {
                let role = match r.decl.role {
                    Role::Engine => "engine",
                    Role::Staged => "staged",
                    Role::Output => "output",
                };
                (r.decl.name, py_dtype(r.dtype), r.shape, role, r.decl.doc)
            })
            .collect())
    }

    #[getter]
    fn hidden_size(&self) -> u64 {
        self.inner.model.hidden as u64
    }
    #[getter]
    fn vocab_size(&self) -> u64 {
        self.inner.model.vocab as u64
    }
    #[getter]
    fn num_layers(&self) -> u64 {
        self.inner.model.layers as u64
    }
    /// Tensor-parallel ranks of the plan (1: unsharded).
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.capture.tp.size
    }
    /// The rank whose share the plan computes.
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.inner.capture.tp.rank
    }
    /// "vocab" (the embedding split by vocabulary, as the engines hold it) or "replicated".
    #[getter]
    fn tp_embedding(&self) -> &'static str {
        if self.inner.capture.tp.vocab_embedding {
            "vocab"
        } else {
            "replicated"
        }
    }
    #[getter]
    fn num_kv_heads(&self) -> u64 {
        self.inner.model.kv_heads as u64
    }
    #[getter]
    fn num_heads(&self) -> u64 {
        self.inner.model.heads as u64
    }
    #[getter]
    fn head_dim(&self) -> u64 {
        self.inner.model.head_dim as u64
    }
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.capture.page_size
    }
    #[getter]
    fn max_requests(&self) -> u32 {
        self.inner.capture.max_requests
    }
    #[getter]
    fn max_context_len(&self) -> u32 {
        self.inner.capture.max_context_len
    }
    /// "bf16" or "fp16": the activations, K/V and weights.
    #[getter]
    fn dtype(&self) -> &'static str {
        py_dtype(self.inner.capture.dtype)
    }
    /// Width of a row of the input hidden states (3 × the target's hidden size for EAGLE-3).
    #[getter]
    fn hidden_in_size(&self) -> u64 {
        self.inner.model.hidden_in() as u64
    }
    /// "eagle1" (EAGLE-1/2) or "eagle3".
    #[getter]
    fn head(&self) -> &'static str {
        self.inner.model.head.name()
    }
    /// lm_head rows: the draft vocabulary of an EAGLE-3 head, else the target's.
    #[getter]
    fn draft_vocab_size(&self) -> u64 {
        self.inner.model.lm_vocab() as u64
    }
    /// What the head emits besides its hidden row: "topk", "logits" or "topk,logits".
    #[getter]
    fn outputs(&self) -> &'static str {
        self.inner.capture.outputs.name()
    }
    /// Columns of the `logits` output (the lm_head's rows: hot, draft or target vocabulary).
    #[getter]
    fn logits_size(&self) -> u64 {
        specplan_format::signature::logits_cols(&self.inner) as u64
    }
    /// FR-Spec's hot vocabulary size (None without FR-Spec).
    #[getter]
    fn hot_vocab_size(&self) -> Option<u32> {
        self.inner.capture.hot_vocab_size
    }
    #[getter]
    fn intermediate_size(&self) -> u64 {
        self.inner.model.intermediate as u64
    }
    #[getter]
    fn rms_norm_eps(&self) -> f32 {
        self.inner.model.rms_norm_eps
    }
    /// RoPE inverse frequencies after scaling, `[head_dim / 2]` (what the kernels use).
    #[getter]
    fn rope_inv_freq(&self) -> Vec<f32> {
        self.inner.rope_inv_freq.clone()
    }
    /// Per layer, the sliding window (None: full causal attention).
    #[getter]
    fn sliding_windows(&self) -> Vec<Option<u32>> {
        self.inner.layers.iter().map(|l| l.window).collect()
    }
    #[getter]
    fn fc_bias(&self) -> bool {
        self.inner.model.fc_bias
    }
    /// Whether every kernel carries a binary (a plan compiled with no_kernels=True cannot
    /// run on a GPU).
    #[getter]
    fn has_kernels(&self) -> bool {
        self.inner.kernels.iter().all(|k| k.binary.is_some())
    }

    /// The weights the plan reads, as `[(name, dtype, shape, sources)]`: a runner takes a
    /// tensor under the name itself (used in place) or under its sources (packed once).
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows: Vec<(String, &'static str, Vec<u64>, Vec<String>)> = self
            .inner
            .weights
            .iter()
            .map(|w| (w.name.clone(), w.dtype.name(), w.shape.clone(), w.sources.clone()))
            .collect();
        PyList::new(py, rows)
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan({:?}, buckets={:?}, num_draft_tokens={}, topk={}, dtype={})",
            self.inner.name,
            self.buckets(),
            self.num_draft_tokens(),
            self.topk(),
            self.dtype()
        )
    }
}

/// Where NVRTC was found (or every place looked at), for `specplan.doctor()`.
#[pyfunction]
#[pyo3(signature = (nvidia_dirs=Vec::new()))]
pub fn nvrtc_report(nvidia_dirs: Vec<PathBuf>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    match specplan_compiler::nvrtc_locate::locate(&nvidia_dirs) {
        Ok(found) => {
            out.insert("nvrtc_origin".into(), found.origin.clone());
            out.insert(
                "nvrtc_library".into(),
                found
                    .library
                    .as_ref()
                    .map_or("on the loader path".into(), |p| p.display().to_string()),
            );
            out.insert("cuda_include".into(), found.include_dir.display().to_string());
            match Jit::discover(&nvidia_dirs) {
                Ok(j) => out.insert("nvrtc_version".into(), j.version),
                Err(e) => out.insert("nvrtc_error".into(), e.to_string()),
            };
        }
        Err(tried) => {
            out.insert("nvrtc_error".into(), format!("not found; looked at: {tried}"));
        }
    }
    out
}
