"""specplan: compiled draft-extend plans for EAGLE speculative decoding, replayed as CUDA
graphs on an engine's own KV cache, page table, weights and stream.

    import specplan
    plan = specplan.Plan.compile(preset="tiny")          # or Plan.load("p.plan")
    engine = specplan.Engine(plan, weights, k_cache, v_cache, req_to_token=table)  # once
    runner = engine.draft_extend()            # or specplan.DraftExtendRunner(plan, weights, ...)
    out = runner.run(input_ids, hidden_states, req_pool_indices, prefix_lens, accept_lens)
    out.topk_p, out.topk_index, out.hidden_states     # out.logits with outputs="logits"

Importing this package, loading and compiling plans need no GPU and no PyTorch; the runner
needs both (it takes the caller's tensors by address and never links libtorch).
"""

import os
import sys
import warnings

from . import _native
from ._decode import DraftDecodeOutput, DraftDecodeRunner
from ._runner import DeviceError, DraftExtendOutput, DraftExtendRunner, Engine

__version__ = _native.__version__
__all__ = ["Plan", "CompileNote", "Engine", "DraftExtendRunner", "DraftExtendOutput", "DraftDecodeRunner",
           "DraftDecodeOutput", "DeviceError", "doctor"]


def _nvidia_dirs():
    """`nvidia` wheel folders on this interpreter's path (where pip put nvidia-cuda-nvrtc
    and nvidia-cuda-runtime, this package's dependencies)."""
    out = []
    for entry in sys.path:
        d = os.path.join(entry or ".", "nvidia")
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


class CompileNote(UserWarning):
    """A note of `Plan.compile` on how the config was read (the CLI prints it as `note:`)."""


class Plan:
    """A validated plan. `Plan.load(path)` or `Plan.compile(preset=..., **flags)`."""

    __slots__ = ("_p",)

    def __init__(self, native):
        if not isinstance(native, _native.Plan):
            raise TypeError("use Plan.load(path) or Plan.compile(...)")
        self._p = native

    @classmethod
    def load(cls, path, *, rebuild_kernels=False):
        """Loads and validates a plan file; ValueError with the plan error on a bad file.
        rebuild_kernels=True compiles every kernel here (NVRTC) from the plan's validated
        constants instead of running the machine code the file carries: for plans from
        elsewhere (a plan file is integrity-checked, not authenticated)."""
        p = _native.Plan.load(os.fspath(path))
        if rebuild_kernels:
            p = p.rebuild_kernels(_nvidia_dirs())
        return cls(p)

    @classmethod
    def from_bytes(cls, data):
        return cls(_native.Plan.from_bytes(bytes(data)))

    @classmethod
    def compile(cls, preset=None, *, config=None, hf_config=None, **flags):
        """Compiles a plan from a preset, a TOML config or a Hugging Face config.json, with
        the CLI's flags in snake_case (`speculative_num_draft_tokens=8` or
        `num_draft_tokens=8`, `buckets=[1, 8, 32]`, `page_size=1`, `max_context_len=4096`,
        `no_kernels=True`, ...). NVRTC is found by itself (this environment's nvidia wheels,
        the .ci/with-nvrtc cache, CUDA_HOME, /usr/local/cuda)."""
        cfg = os.fspath(config) if config is not None else None
        hf = os.fspath(hf_config) if hf_config is not None else None
        plan = cls(_native.Plan.compile(preset, cfg, hf, flags, _nvidia_dirs()))
        # The CLI's `note:` lines: how the config was read where it may surprise (a serving
        # context above the head's training length, mrope read as plain RoPE). Filter them
        # with warnings.simplefilter("ignore", specplan.CompileNote); `plan.notes` keeps them.
        for note in plan.notes:
            warnings.warn(note, CompileNote, stacklevel=2)
        return plan

    def save(self, path):
        self._p.save(os.fspath(path))

    def text(self):
        """The canonical text, one fact per line (as `specplan show` prints it)."""
        return self._p.text()

    def weights(self):
        """[(name, dtype, shape, sources)] of every weight the plan reads."""
        return self._p.weights()

    @property
    def notes(self):
        """The config reader's notes of this compile (empty for a loaded plan)."""
        return self._p.notes

    def phases(self):
        """The forwards the plan compiles: [(kind, rows per request, buckets)]."""
        return self._p.phases()

    def memory(self):
        """What each phase needs before anything runs, by label ("draft_extend",
        "draft_decode:3", ...): {"arena_bytes": its largest bucket's arena (the runtime
        allocates one arena, the largest over all phases), "bucket_arena_bytes": {batch:
        bytes}, "positions_per_request": positions past a request's prefix one step writes
        or reserves (what the engine's table row must hold beyond the prefix)}."""
        return {
            label: {"arena_bytes": arena, "bucket_arena_bytes": dict(per), "positions_per_request": pos}
            for label, arena, per, pos in self._p.memory()
        }

    def signature(self, batch=1, phase="draft_extend"):
        """The tensors `phase` exchanges with its caller at `batch` requests, as the plan
        declares them: [(name, dtype, shape, role, doc)] with role "engine" (registered
        once), "staged" (given each step) or "output"."""
        return self._p.signature(int(batch), phase)

    def __repr__(self):
        return repr(self._p)


def _plan_property(name, doc):
    return property(lambda self: getattr(self._p, name), doc=doc)


for _name, _doc in [
    ("name", "the plan's name"),
    ("buckets", "batch buckets, ascending"),
    ("graph_buckets", "buckets replayed as CUDA graphs"),
    ("num_draft_tokens", "N: tokens verified per request (the draft-extend rows per request)"),
    ("topk", "top-K of the next draft"),
    ("num_steps", "speculative_num_steps: the draft-decode tier SGLang runs by default"),
    ("hidden_size", "the draft head's hidden size"),
    ("vocab_size", "the draft vocabulary"),
    ("num_layers", "decoder layers of the draft head"),
    ("num_heads", "attention heads"),
    ("num_kv_heads", "K/V heads"),
    ("head_dim", "head dimension"),
    ("page_size", "tokens per KV page"),
    ("max_requests", "request slots (largest batch a step may have)"),
    ("max_context_len", "longest context (prefix + N)"),
    ("dtype", "'bf16' or 'fp16'"),
    ("has_kernels", "whether the plan carries kernel binaries"),
    ("intermediate_size", "the MLP's intermediate size"),
    ("hidden_in_size", "width of an input hidden-state row (3 x the target's for EAGLE-3)"),
    ("head", "'eagle1' or 'eagle3'"),
    ("draft_vocab_size", "lm_head rows (EAGLE-3: the draft vocabulary, mapped by d2t)"),
    ("rms_norm_eps", "RMSNorm epsilon"),
    ("rope_inv_freq", "RoPE inverse frequencies after scaling, [head_dim / 2]"),
    ("sliding_windows", "per layer, the sliding window (None: full causal)"),
    ("fc_bias", "whether fc has a bias"),
    ("outputs", "what the head emits besides its hidden row: 'topk', 'logits' or 'topk,logits'"),
    ("logits_size", "columns of the logits output (the lm_head's rows)"),
    ("hot_vocab_size", "FR-Spec's hot vocabulary size (None without FR-Spec)"),
    ("tp_size", "tensor-parallel ranks of the plan (1: unsharded)"),
    ("tp_rank", "the rank whose share the plan computes"),
    ("tp_embedding", "'vocab' (the embedding split by vocabulary, as the engines hold it) or 'replicated'"),
]:
    setattr(Plan, _name, _plan_property(_name, _doc))


def doctor():
    """What specplan finds on this machine: NVRTC and the CUDA headers (and where it looked),
    the CUDA driver and GPUs, PyTorch. Returns a dict; `python -m specplan` prints it."""
    report = {"specplan": __version__, "python": sys.version.split()[0]}
    report.update(_native.nvrtc_report(_nvidia_dirs()))
    report.update(_native.driver_report())
    try:
        import torch  # noqa: F401 (optional)

        report["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})"
    except ImportError:
        report["torch"] = "not installed (needed for DraftExtendRunner only)"
    problems = []
    if "nvrtc_error" in report:
        problems.append("Plan.compile cannot build kernels (Plan.load and no_kernels=True still work)")
    if report.get("gpus", "0") == "0":
        problems.append("no GPU: DraftExtendRunner cannot be constructed")
    report["would_fail"] = "; ".join(problems) or "nothing"
    return report


def _doctor_main():
    for k, v in doctor().items():
        print(f"{k:>16}: {v}")
    return 0
