"""vLLM 0.33.0's own objects, built for a test on CPU tensors: a real `VllmConfig` (a tiny
Llama target and a tiny EAGLE-3 or EAGLE-1 draft, its checkpoint written as safetensors in
the EAGLE checkpoint names), the target loaded by vLLM's loader (`load_format="dummy"`), the
speculator built by vLLM's `init_speculator` and loaded by its `load_model` (vLLM's
`load_eagle_model`, its safetensors loader, the release's `Eagle3LlamaForCausalLM` /
`EagleLlamaForCausalLM` with the target's embedding and lm_head shared as vLLM shares them),
the real `set_attn` (TRITON_ATTN metadata builders), `init_cudagraph_manager(NONE)`,
`BlockTables` and `init_kv_cache` (`allocate_kv_cache` in the layout asked for), and the
target batch a verify step leaves (`InputBatch`, slot mappings, TRITON_ATTN metadata built by
vLLM's `build_attn_metadata`).

The draft model's forward is vLLM's own: the layers, RoPE and RMSNorm in their native torch
forward (`custom_ops=["none"]`, a config choice), TRITON_ATTN's attention and KV write
(`unified_attention`, `reshape_and_cache_flash`) as triton kernels in triton's CPU interpreter
(TRITON_INTERPRET=1), as are the speculator's own kernels (`prepare_prefill_inputs`,
`prepare_decode_inputs`, `update_draft_inputs`, the block-table and slot-mapping kernels).

Import this module before vLLM: where vLLM is installed it sets (if unset) the environment
vLLM reads when it is imported (the process then sees no CUDA device: these tests are CPU-only).
  VLLM_TARGET_DEVICE=cpu   vLLM picks CpuPlatform (platforms/__init__.py:174-181); without it
                           VllmConfig() fails to infer a device (config/device.py:55).
  CUDA_VISIBLE_DEVICES=""  keeps HAS_TRITON True with no driver (triton_utils/importing.py:
                           50-78), so `triton.jit` is triton's (MRv2 needs it too).
  TRITON_INTERPRET=1       triton runs the kernels on CPU tensors.
vLLM's CUDA .so files fail to load here (libcuda.so.1) and vLLM falls back by itself, so
`cuda_stubs` serves nothing for vLLM (`CUDA_STUBS` is empty).

`PATCHES` (applied by `prepare()`, once) lists every attribute replaced, each with the
reason; each stands in for a CUDA-only API or the CUDA platform's choice, except the last
two: one keeps vLLM off its CPU extension's AMX GEMMs (applied only on a CPU with AMX tiles),
one stands in for a package the CPU venv does not carry (applied only without it).
"""

import contextlib
import importlib.util
import json
import os
import tempfile



def _real_vllm():
    """Whether vLLM itself is installed (not absent, not cuda_stubs' stand-in for SGLang)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and bool(spec.origin) and os.path.exists(spec.origin)


REAL_VLLM = _real_vllm()
if REAL_VLLM:
    # Only where vLLM is installed: elsewhere (SGLang's venv) nothing here changes the process.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cuda_stubs  # noqa: E402

CUDA_STUBS = []  # vLLM needs none (see above); cuda_stubs.CALLS must stay empty all the same
assert cuda_stubs.CALLS == []

# Shapes: a 2-layer Llama target and a 1-layer draft, hidden 64, 4 heads (2 K/V heads) of 16.
H, NH, NKV, D, INTER = 64, 4, 2, 16, 128
V, VD = 256, 128  # target vocabulary; EAGLE-3 draft vocabulary (d2t maps it)
TARGET_LAYERS = 2
K = 3  # num_speculative_tokens
N = K + 1  # verify tokens per decode request
BLOCK = 16
NUM_BLOCKS = 48
BLOCKS_PER_ROW = 5
MAX_REQS = 8
MAX_TOKENS = 64
CTX = 256
DRAFT_LAYER = f"model.layers.{TARGET_LAYERS}.self_attn.attn"  # start_layer_id = target layers

PATCHES = {}
_STATE = {"prepared": False, "dist": False}
ATTENTION_CALLS = []  # filled inside record_attention()
_RECORD = {"on": False}


def paged_attention(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size,
                    softcap, alibi_slopes=None, sinks=None, output_scale=None, q_descale=None, mm_prefix_range=None,
                    rswa_window=None, chunk_lookback=-1, **kw):
    """Causal (GQA) attention of each sequence's query rows over its paged K/V, as vLLM's
    unified_attention computes it: q [T, Hq, D]; k, v [blocks, block, Hk, D] views of the
    cache; sequence i owns query rows cu[i]..cu[i+1] and seqused_k[i] keys at positions
    0..len-1 in blocks block_table[i, p // block]; its query row j sits at position
    len - q_len + j and sees keys 0..that position. Float32 math, `out` rows written."""
    import torch

    assert causal is True and tuple(window_size or (-1, -1)) == (-1, -1) and not softcap
    assert alibi_slopes is None and sinks is None and output_scale is None and q_descale is None
    assert mm_prefix_range is None and not rswa_window and chunk_lookback == -1
    if _RECORD["on"]:
        clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
        ATTENTION_CALLS.append(dict(
            q=q.clone(), k=k.clone(), v=v.clone(), out=out.clone(), cu_seqlens_q=cu_seqlens_q.clone(),
            seqused_k=seqused_k.clone(), block_table=block_table.clone(), softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            output_scale=output_scale, q_descale=q_descale, mm_prefix_range=mm_prefix_range,
            rswa_window=rswa_window, chunk_lookback=chunk_lookback, **{n: clone(x) for n, x in kw.items()}))
    block, hk, hq = k.shape[1], k.shape[2], q.shape[1]
    cu = cu_seqlens_q.tolist()
    lens = seqused_k.tolist()
    for i in range(len(cu) - 1):
        lo, hi = cu[i], cu[i + 1]
        if hi <= lo:
            continue
        length = lens[i]
        pos = torch.arange(length)
        blocks = block_table[i, pos // block].long()
        keys = k[blocks, pos % block].float()  # [len, Hk, D]
        vals = v[blocks, pos % block].float()
        group = torch.arange(hq) * hk // hq
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys[:, group]) * softmax_scale
        last = length - (hi - lo) + torch.arange(hi - lo)
        scores = scores.masked_fill(pos[None, None, :] > last[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vals[:, group]).to(out.dtype)


@contextlib.contextmanager
def record_attention():
    """ATTENTION_CALLS gets every attention call of the block (its arguments, cloned)."""
    ATTENTION_CALLS.clear()
    _RECORD["on"] = True
    try:
        yield ATTENTION_CALLS
    finally:
        _RECORD["on"] = False


def vllm_attention_kernel(call):
    """vLLM's own unified_attention kernel (triton's interpreter) on a recorded call, in
    float32: its output, and the stand-in's on the same float32 inputs."""
    import torch

    args = dict(call)
    for n in ("q", "k", "v"):
        args[n] = args[n].float()
    got = torch.zeros(args["out"].shape, dtype=torch.float32)
    mine = torch.zeros_like(got)
    for name in ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"):
        if isinstance(args.get(name), torch.Tensor):
            args[name] = torch.zeros_like(args[name], dtype=torch.float32)
    _STATE["kernel"](**{**args, "out": got})
    paged_attention(**{**args, "out": mine})
    return got, mine


def prepare():
    """The CUDA-only stand-ins (once per process) and vLLM's gloo world of one."""
    if _STATE["prepared"]:
        return
    import torch

    import vllm.model_executor.model_loader.base_loader as base_loader
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def patch(name, owner, attr, value, why):
        setattr(owner, attr, value)
        PATCHES[name] = why

    patch(
        "vllm.v1.worker.gpu.buffer_utils.is_uva_available", buffer_utils, "is_uva_available", lambda: False,
        "UvaBuffer pins host memory and maps it for the device (torch.ops._C.get_cuda_view_from_cpu_tensor, "
        "buffer_utils.py:32-41), which needs the CUDA driver; CpuPlatform still reports UVA "
        "(utils/platform_utils.py:50-57). False selects vLLM's own NonUvaBuffer (buffer_utils.py:44-61), used "
        "by BlockTables (block_table.py:73) and StagedWriteTensor (buffer_utils.py:174-179).",
    )
    triton_attn = AttentionBackendEnum.TRITON_ATTN.get_path()
    patch(
        "vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls", CpuPlatform, "get_attn_backend_cls",
        classmethod(lambda cls, *a, **k: triton_attn),
        "CpuPlatform always picks CPU_ATTN (platforms/cpu.py:188-197), whose kernels are vLLM's CPU C++ ops, "
        "not in the CUDA wheel; the CUDA platform picks FLASH_ATTN or TRITON_ATTN. TRITON_ATTN (what the "
        "layers, set_attn's builders and the forward use here) runs in triton's interpreter.",
    )
    cuda_capability = torch.cuda.get_device_capability

    def get_device_capability(device=None):
        if isinstance(device, torch.device) and device.type == "cpu":
            return (9, 0)
        return cuda_capability(device)

    patch(
        "torch.cuda.get_device_capability", torch.cuda, "get_device_capability", get_device_capability,
        "triton_reshape_and_cache_flash (v1/attention/ops/triton_reshape_and_cache_flash.py:445) asks the CUDA "
        "device's compute capability for a tile-size heuristic; for a CPU tensor the stand-in answers (9, 0), "
        "an H200's (only a tile size depends on it). CUDA devices get torch's answer.",
    )

    import vllm.v1.attention.backends.triton_attn as triton_attn_mod

    _STATE["kernel"] = triton_attn_mod.unified_attention
    patch(
        "vllm.v1.attention.backends.triton_attn.unified_attention", triton_attn_mod, "unified_attention",
        paged_attention,
        "vLLM's unified_attention triton kernel (v1/attention/ops/triton_unified_attention.py:828), which "
        "TritonAttentionImpl.forward calls (v1/attention/backends/triton_attn.py:697), returns garbage (~8e8) "
        "for bfloat16 inputs in triton 3.8's interpreter (float32 is exact) and takes seconds per call there. "
        "The stand-in (paged_attention) is the same causal GQA attention over the same paged K/V views, "
        "block table, lengths and scale in torch float32, writing vLLM's bfloat16 output; "
        "test_the_attention_stand_in_is_vllms_kernel replays recorded calls of these tests through vLLM's "
        "kernel on float32 and finds the same result. The KV write stays vLLM's kernel "
        "(reshape_and_cache_flash, bfloat16, run by the interpreter).",
    )

    @contextlib.contextmanager
    def graph_capture(device):
        yield None

    patch(
        "vllm.v1.worker.gpu.cudagraph_utils.graph_capture", cudagraph_utils, "graph_capture", graph_capture,
        "CudaGraphManager.capture enters graph_capture (v1/worker/gpu/cudagraph_utils.py:430), which makes a "
        "torch.cuda.Stream (distributed/parallel_state.py:1712). With CUDAGraphMode.NONE it captures nothing; "
        "only the speculator's capture() test reaches it.",
    )
    import vllm.model_executor.layers.utils as layer_utils

    if torch.cpu._is_amx_tile_supported() and not hasattr(torch.ops._C, "convert_weight_packed"):
        patch(
            "vllm.model_executor.layers.utils.check_cpu_sgl_kernel", layer_utils, "check_cpu_sgl_kernel",
            lambda n, k, dtype: False,
            "On a CPU with AMX tiles, dispatch_cpu_unquantized_gemm (model_executor/layers/utils.py:621-624) "
            "packs bf16 weights with torch.ops._C.convert_weight_packed, an op of vLLM's CPU extension, which "
            "the CUDA wheel does not carry. False is the answer on a CPU without AMX (utils.py:501-507): the "
            "GEMMs stay torch's F.linear. Applied only on such a CPU, where the op is missing.",
        )
    if importlib.util.find_spec("compressed_tensors") is None:
        patch(
            "vllm.model_executor.model_loader.base_loader._get_online_quantization_config", base_loader,
            "_get_online_quantization_config", lambda vllm_config: None,
            "vLLM's loader asks for an online-quantization config (base_loader.py:58, :112, :127-139) by "
            "importing quantization/online/base.py, which imports the compressed_tensors package (a vLLM "
            "requirement the CPU venv leaves out). Nothing is quantized here: the answer is None. Applied only "
            "where compressed_tensors is not installed.",
        )
    _STATE["prepared"] = True


def _init_dist(vc, tmp):
    """get_pp_group() is read by CudaGraphManager.__init__ (v1/worker/gpu/cudagraph_utils.py:173) and
    the loaders: one gloo rank, a file:// rendezvous (no network)."""
    if _STATE["dist"]:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{tmp}/dist",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    _STATE["dist"] = True


# ---- configs and the draft checkpoint ----

def _common():
    return {
        "model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": D, "vocab_size": V, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }


def write_model_dirs(tmp, *, eagle3, seed):
    """The target's config.json, and the draft's config.json (what vLLM and `specplan compile
    --hf-config` both read) with a safetensors checkpoint of random weights in the EAGLE names
    (`midlayer.*` for EAGLE-3, `layers.0.*` for EAGLE-1, separate q/k/v and gate/up). EAGLE-3:
    its own lm_head over VD ids and `d2t` offsets (target = draft id + d2t), no embedding (it
    shares the target's); EAGLE-1: its own embedding, no lm_head (it shares the target's)."""
    import torch
    from safetensors.torch import save_file

    target, draft = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
    os.makedirs(target)
    os.makedirs(draft)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump({**_common(), "architectures": ["LlamaForCausalLM"], "num_hidden_layers": TARGET_LAYERS}, f)
    cfg = {**_common(), "num_hidden_layers": 1}
    if eagle3:
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD, target_hidden_size=H)
    else:
        # An EAGLE-1 head as vLLM takes it: a Llama config, which vLLM's EAGLEConfig renames
        # EagleLlamaForCausalLM (transformers_utils/configs/eagle.py:46-54; SGLang's
        # "LlamaForCausalLMEagle" would become the unregistered "EagleLlamaForCausalLMEagle").
        # vLLM's EAGLE-1 fc has no bias (llama_eagle.py:110-118): so the plan has none either.
        cfg.update(architectures=["LlamaForCausalLM"], bias=False)
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(cfg, f)

    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (0.08 * torch.randn(*s, generator=g)).to(torch.bfloat16)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)  # noqa: E731
    pre = "midlayer." if eagle3 else "layers.0."
    h_in = 2 * H if eagle3 else H
    sd = {
        pre + "self_attn.q_proj.weight": w(NH * D, h_in),
        pre + "self_attn.k_proj.weight": w(NKV * D, h_in),
        pre + "self_attn.v_proj.weight": w(NKV * D, h_in),
        pre + "self_attn.o_proj.weight": w(H, NH * D),
        pre + "mlp.gate_proj.weight": w(INTER, H),
        pre + "mlp.up_proj.weight": w(INTER, H),
        pre + "mlp.down_proj.weight": w(H, INTER),
        pre + "post_attention_layernorm.weight": norm(H),
    }
    if eagle3:
        targets = torch.randperm(V, generator=g)[:VD].sort().values
        sd.update({
            pre + "input_layernorm.weight": norm(H), pre + "hidden_norm.weight": norm(H), "norm.weight": norm(H),
            "fc.weight": w(H, 3 * H), "lm_head.weight": (0.3 * torch.randn(VD, H, generator=g)).to(torch.bfloat16),
            "d2t": (targets - torch.arange(VD)).to(torch.int64), "t2d": torch.zeros(V, dtype=torch.bool),
        })
    else:
        sd.update({"fc.weight": w(H, 2 * H), "embed_tokens.weight": (0.5 * torch.randn(V, H, generator=g)).to(torch.bfloat16)})
    save_file(sd, os.path.join(draft, "model.safetensors"))
    return target, draft


def vllm_config(target, draft, *, eagle3, layout, block=BLOCK):
    from vllm.config import (CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                             VllmConfig)

    mc = ModelConfig(model=target, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=CTX, enforce_eager=True)
    pc = ParallelConfig()
    sc = SpeculativeConfig(method="eagle3" if eagle3 else "eagle", model=draft, num_speculative_tokens=K,
                           target_model_config=mc, target_parallel_config=pc)
    sched = SchedulerConfig(max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS, max_model_len=CTX,
                            is_encoder_decoder=False)
    # custom_ops none: vLLM's CustomOps (RMSNorm, RoPE, SiluAndMul) run their forward_native
    # (their CPU forward calls vLLM's CPU C++ ops, absent from the CUDA wheel).
    vc = VllmConfig(model_config=mc, parallel_config=pc, speculative_config=sc, scheduler_config=sched,
                    compilation_config=CompilationConfig(custom_ops=["none"]))
    # The layout the engine core resolves (resolve_kv_cache_layout) and init_kv_cache reads.
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.block_size = block  # --block-size: the manager's block (FA/Triton kernels take it whole)
    return vc


def compile_plan(draft, **over):
    import specplan

    flags = dict(speculative_eagle_topk=1, speculative_num_steps=K, speculative_num_draft_tokens=N,
                 page_size=BLOCK, max_context_len=CTX, buckets=[1, 2, 4, 8], outputs="topk", no_kernels=True)
    flags.update(over)
    return specplan.Plan.compile(hf_config=os.path.join(draft, "config.json"), **flags)


# ---- one speculator on vLLM's objects ----

class Case:
    """vLLM's speculator for one head and KV layout, with `plan` installed (None: vLLM's own
    EagleSpeculator), its KV cache bound and filled with random K/V (every byte of the one
    KV buffer the target and draft layers share)."""

    def __init__(self, *, eagle3, layout="LBNHC", block=BLOCK, plan=True, seed=0, plan_flags=None, build=True):
        import torch

        prepare()
        import specplan.vllm as sp_vllm

        self.eagle3, self.layout, self.block, self.seed = eagle3, layout, block, seed
        self.tmp = tempfile.mkdtemp(prefix="vllm-specplan-")
        self.target_dir, self.draft_dir = write_model_dirs(self.tmp, eagle3=eagle3, seed=seed)
        self.vc = vllm_config(self.target_dir, self.draft_dir, eagle3=eagle3, layout=layout, block=block)
        _init_dist(self.vc, self.tmp)
        self.plan = compile_plan(self.draft_dir, **{"page_size": block, **(plan_flags or {})}) if plan else None
        if self.plan is not None:
            self.cls = sp_vllm.install(self.plan)
        else:
            sp_vllm.uninstall()
            self.cls = None
        self.device = torch.device("cpu")
        if build:
            self.build()

    def build(self):
        import torch

        from vllm.config import LoadConfig, set_current_vllm_config
        from vllm.model_executor.model_loader import get_model
        from vllm.v1.worker.gpu.spec_decode import init_speculator

        vc = self.vc
        with set_current_vllm_config(vc):
            # As GPUModelRunner: __init__ builds the speculator (MR:297-304), load_model loads the
            # target, then the speculator (MR:385-424).
            self.s = init_speculator(vc, self.device, None)
            self.target = get_model(vllm_config=vc, load_config=LoadConfig(load_format="dummy"))
            g = torch.Generator().manual_seed(self.seed + 1)
            for t, scale in ((self.target.model.embed_tokens.weight, 0.5), (self.target.lm_head.weight, 0.3)):
                t.data.copy_((scale * torch.randn(t.shape, generator=g)).to(t.dtype))
            self.s.load_model(self.target)
        self.sfc = vc.compilation_config.static_forward_context

    def bind(self, *, block_tables=None):
        """MR.initialize_kv_cache's order (MR:611-812): the KV cache config (one group: target
        and draft layers, as vLLM groups equal specs), BlockTables, set_attn,
        init_cudagraph_manager(NONE), init_kv_cache. Then random K/V everywhere and each
        request-state row's blocks."""
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.kv_cache_interface import (KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                                compute_layout_strides)
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.gpu.attn_utils import init_kv_cache
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers

        vc, s = self.vc, self.s
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS)] + [DRAFT_LAYER]
        assert set(layers) <= set(self.sfc), sorted(self.sfc)
        spec = self.sfc[DRAFT_LAYER].get_kv_cache_spec(vc)
        layout = KVCacheLayout[self.layout]
        page = spec.page_size_bytes
        # Strides as the engine core plans them (v1/core/kv_cache_planning.py:676-726): block-outer
        # layouts interleave every layer's page per block.
        interleaved = page * len(layers) if layout.is_block_outermost else None
        layer_stride, block_stride, _, _, _ = compute_layout_strides(
            spec, NUM_BLOCKS, len(layers), layout, fixed_strides=(None, interleaved, None, None, None))
        tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(layers), layers=layers, layer_stride=layer_stride,
                               block_stride=block_stride)
        self.kv_cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                                    kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
        width = CTX // self.block
        self.bt = BlockTables([self.block], MAX_REQS, MAX_TOKENS, [width], self.device)
        self.target_buffers = InputBuffers(MAX_REQS, MAX_TOKENS, self.device)
        with set_current_vllm_config(vc):
            s.set_attn(None, self.kv_cfg, self.bt, self.target_buffers, [[]])
            s.init_cudagraph_manager(CUDAGraphMode.NONE)
            init_kv_cache(self.sfc, self.kv_cfg, self.device, [self.block], vc, block_tables=self.bt,
                          attn_groups=[g for gs in s.attn_groups for g in gs])
        self.kv = self.sfc[DRAFT_LAYER].kv_cache
        assert self.kv.dtype == torch.bfloat16 and tuple(self.kv.shape) == (NUM_BLOCKS, NKV, self.block, 2 * D)
        # The whole KV buffer as bf16 elements; `index` maps the draft layer's logical
        # [B, H, N, 2D] to element offsets in it.
        storage = self.kv.untyped_storage()
        self.flat = torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, (storage.nbytes() // 2,))
        self.index = torch.arange(self.flat.numel()).as_strided(self.kv.shape, self.kv.stride(),
                                                                self.kv.storage_offset())
        g = torch.Generator().manual_seed(self.seed + 2)
        self.flat.copy_(torch.randn(self.flat.numel(), generator=g).to(torch.bfloat16))
        self.kv0 = self.flat.clone()
        # Each request-state row's blocks: BLOCKS_PER_ROW distinct blocks in shuffled order
        # (block 0 unused), so a request's context may reach BLOCKS_PER_ROW * block tokens.
        perm = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
        self.tables = block_tables or {
            row: perm[row * BLOCKS_PER_ROW:(row + 1) * BLOCKS_PER_ROW] for row in range(MAX_REQS)
        }
        for row, ids in self.tables.items():
            self.bt.append_block_ids(row, (list(ids),), overwrite=True)
        self.bt.apply_staged_writes()
        self._buffers0 = self._snapshot_buffers()

    # ---- the speculator's persistent buffers: one state for every run ----

    def _buffers(self):
        import torch

        s = self.s
        out = {}
        for owner, prefix in ((s, ""), (s.input_buffers, "input_buffers.")):
            for name, t in vars(owner).items():
                if isinstance(t, torch.Tensor) and t.numel() and not t.is_inference():
                    out[prefix + name] = t
        return out

    def _snapshot_buffers(self):
        return {k: t.clone() for k, t in self._buffers().items()}

    def restore(self, *, stale=None):
        """The KV buffer and the speculator's buffers as after bind(); `stale(s)` then writes
        what a previous step left in them."""
        import torch

        self.flat.copy_(self.kv0)
        with torch.inference_mode(False):
            for k, t in self._buffers().items():
                t.copy_(self._buffers0[k])
        if stale is not None:
            stale(self.s)

    # ---- KV views ----

    def slot_index(self, slots):
        """Element offsets [n, H, 2D] of the draft layer's K|V rows at token slots."""
        s = slots.long()
        return self.index[s // self.block, :, s % self.block, :]

    def slot_kv(self, flat, slots):
        return flat[self.slot_index(slots)]

    def unchanged_outside(self, flat, slots):
        """Whether every KV element except the draft layer's rows at `slots` keeps its bits."""
        import torch

        keep = torch.ones(flat.numel(), dtype=torch.bool)
        keep[self.slot_index(slots).flatten()] = False
        return torch.equal(flat.view(torch.int16)[keep], self.kv0.view(torch.int16)[keep])


class Batch:
    """The target's verify step as GPUModelRunner leaves it for `propose` (MR:2296-2323): the
    InputBatch, the target's hidden states (EAGLE-3: the three auxiliary states), the
    sampler's states, and (per run, from vLLM's BlockTables) slot mappings and attention
    metadata. `reqs`: (request-state row, context before this step, query length, num_sampled);
    num_sampled 0 is a chunked prefill (its next prompt token comes from next_prefill_tokens)."""

    def __init__(self, case, reqs, *, pad_tokens=0, seed=3):
        import numpy as np
        import torch

        self.case = case
        g = torch.Generator().manual_seed(seed)
        self.rows = [r[0] for r in reqs]
        self.ctx = [r[1] for r in reqs]
        self.qlens = np.array([r[2] for r in reqs], dtype=np.int32)
        self.num_sampled = torch.tensor([r[3] for r in reqs], dtype=torch.int32)
        decode = [r[3] > 0 for r in reqs]
        # num_rejected = num_logits - num_sampled for a decode, 0 for a chunked prefill (IB:517-562).
        self.num_rejected = torch.tensor([(q - a) if a else 0 for (_, _, q, a) in reqs], dtype=torch.int32)
        self.R = len(reqs)
        self.T = int(self.qlens.sum())
        self.T_p = self.T + pad_tokens
        self.qsl_np = np.concatenate([[0], np.cumsum(self.qlens)]).astype(np.int32)
        self.idx_mapping = torch.tensor(self.rows, dtype=torch.int64)
        self.positions = torch.zeros(self.T_p, dtype=torch.int64)
        for i, (c, q) in enumerate(zip(self.ctx, self.qlens)):
            self.positions[self.qsl_np[i]:self.qsl_np[i + 1]] = torch.arange(c, c + int(q))
        self.seq_lens = torch.tensor([c + int(q) for c, q in zip(self.ctx, self.qlens)], dtype=torch.int32)
        self.input_ids = torch.randint(0, V, (self.T_p,), generator=g, dtype=torch.int32)
        self.last_sampled = torch.randint(0, V, (MAX_REQS, 1), generator=g, dtype=torch.int64)
        self.next_prefill = torch.randint(0, V, (1, MAX_REQS), generator=g, dtype=torch.int32)
        self.temperature = torch.zeros(MAX_REQS, dtype=torch.float32)
        self.seeds = torch.arange(MAX_REQS, dtype=torch.int64)
        self.aux = [torch.randn(self.T_p, H, generator=g).to(torch.bfloat16) for _ in range(3)]
        self.last_hidden = torch.randn(self.T_p, H, generator=g).to(torch.bfloat16)
        # What earlier steps left in the draft's input buffers: ids, and positions equal to the
        # target's (so the rows past each accepted length, which vLLM's prefill runs on stale
        # positions, are computed at the same positions in both runs).
        self.stale_ids = torch.randint(0, V, (MAX_TOKENS,), generator=g, dtype=torch.int32)
        self.is_prefilling = np.array([not d for d in decode])
        uniform = all(int(q) == N for q in self.qlens) and all(decode)
        self.decode_graph_eligible = uniform

    def stale(self, s):
        s.input_buffers.input_ids.copy_(self.stale_ids)
        s.input_buffers.positions[: self.T].copy_(self.positions[: self.T])

    def input_batch(self):
        import numpy as np
        import torch

        from vllm.v1.worker.gpu.input_batch import InputBatch

        R, T = self.R, self.T
        qsl = torch.from_numpy(self.qsl_np.copy())
        num_logits = [int(q) if a else 1 for q, a in zip(self.qlens, self.num_sampled.tolist())]
        cu = np.concatenate([[0], np.cumsum(num_logits)]).astype(np.int32)
        drafts = np.array([int(q) - 1 if a else 0 for q, a in zip(self.qlens, self.num_sampled.tolist())])
        return InputBatch(
            req_ids=[f"r{i}" for i in range(R)], num_reqs=R, num_reqs_after_padding=R,
            idx_mapping=self.idx_mapping, idx_mapping_np=self.idx_mapping.numpy(),
            expanded_idx_mapping=self.idx_mapping, expanded_local_pos=torch.zeros(R, dtype=torch.int32),
            num_scheduled_tokens=self.qlens, num_tokens=T, num_tokens_after_padding=self.T_p,
            num_draft_tokens=int(drafts.sum()), num_draft_tokens_per_req=drafts,
            query_start_loc=qsl, query_start_loc_np=self.qsl_np, seq_lens=self.seq_lens,
            seq_lens_cpu_upper_bound=self.seq_lens.clone(), dcp_local_seq_lens=None,
            num_computed_tokens_np=np.array(self.ctx, dtype=np.int32),
            prefill_len_np=np.array([c + 1 for c in self.ctx], dtype=np.int32),
            num_computed_prefill_tokens_np=np.array([c + 1 for c in self.ctx], dtype=np.int32),
            is_prefilling_np=self.is_prefilling, has_prefill=bool(self.is_prefilling.any()),
            decode_graph_eligible=self.decode_graph_eligible, input_ids=self.input_ids, positions=self.positions,
            is_padding=torch.arange(self.T_p) >= T, logits_indices=torch.arange(cu[-1]),
            cu_num_logits=torch.from_numpy(cu), cu_num_logits_np=cu, has_structured_output_reqs=False,
            prompt_lens=None,
        )

    def target_inputs(self):
        """What MR.prepare_inputs builds each step: the batch-order block tables, the slot
        mappings (PAD_SLOT_ID past the real tokens), the attention metadata by the TRITON_ATTN
        builder (vLLM's build_attn_metadata, as ModelState.prepare_attn calls it)."""
        import torch

        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer

        c = self.case
        qsl = torch.from_numpy(self.qsl_np.copy())
        c.bt.gather_block_tables(self.idx_mapping, num_reqs_padded=self.R)
        slots = c.bt.compute_slot_mappings(self.idx_mapping, qsl, self.positions, self.T_p)
        self.slots = slots[0, : self.T].clone()
        md = build_attn_metadata(
            attn_groups=c.s.attn_groups, num_reqs=self.R, num_tokens=self.T, query_start_loc_gpu=qsl,
            query_start_loc_cpu=qsl.clone(), max_query_len=int(self.qlens.max()), seq_lens=self.seq_lens,
            max_seq_len=int(self.seq_lens.max()), block_tables=c.bt.input_block_tables, slot_mappings=slots,
            kv_cache_config=c.kv_cfg, seq_lens_cpu_upper_bound=self.seq_lens.clone(), positions=self.positions,
            is_prefilling=torch.from_numpy(self.is_prefilling.copy()),
        )
        return md, build_slot_mappings_by_layer(slots, c.kv_cfg)


class Run:
    """One `propose`: the drafts it returned, what its first pass (`_prefill`) left, and the
    draft logits vLLM computed (`compute_draft_logits`, one [R, V] per call: every step of
    vLLM's own prefill and decode loop; the decode steps only where specplan drafted the first)."""

    def __init__(self):
        self.drafts = None
        self.first = None
        self.prefills = 0
        self.logits = []


@contextlib.contextmanager
def spy_runner():
    """Every `DraftExtendRunner.run` of the block: its arguments (cloned) and outputs."""
    from specplan import _runner

    calls = []
    run = _runner.DraftExtendRunner.run

    def spy(self, *args, **kwargs):
        clone = lambda t: t.clone() if hasattr(t, "clone") else t  # noqa: E731
        rec = {"args": [clone(a) for a in args],
               "kwargs": {k: ({n: v for n, v in x.items()} if isinstance(x, dict) else clone(x))
                          for k, x in kwargs.items()}}
        out = run(self, *args, **kwargs)
        rec["topk_index"] = out.topk_index.clone()
        rec["hidden_states"] = out.hidden_states.clone()
        calls.append(rec)
        return out

    _runner.DraftExtendRunner.run = spy
    try:
        yield calls
    finally:
        _runner.DraftExtendRunner.run = run


def propose(case, batch, *, vllm_prefill=False, **kw):
    """vLLM's `propose` on `batch` from the bound state (KV and buffers restored first).
    `vllm_prefill`: the adapter declines the step (vLLM's own `_prefill` serves it)."""
    import torch

    from vllm.config import set_current_vllm_config

    s = case.s
    case.restore(stale=batch.stale)
    md, slots = batch.target_inputs()
    run = Run()
    cls_prefill = type(s)._prefill

    def prefill(*args, **kwargs):
        out = cls_prefill(s, *args, **kwargs)
        r = batch.R
        run.prefills += 1
        run.first = {
            "kv": case.flat.clone(), "draft0": s.draft_tokens[:r, 0].clone(), "hidden": s.hidden_states[:r].clone(),
            "positions": s.input_buffers.positions[:r].clone(), "src": s.sample_src_positions[:r].clone(),
        }
        return out

    def compute_draft_logits(hidden, spec_step_idx):
        logits = cls_logits(s, hidden, spec_step_idx)
        run.logits.append(logits[: batch.R].float().clone())
        return logits

    cls_logits = type(s).compute_draft_logits
    s._prefill = prefill
    s.compute_draft_logits = compute_draft_logits
    if vllm_prefill:
        # vLLM's own step throughout: its prefill and its decode loop.
        s._sp_covers = lambda *a, **k: False
        s._sp_decode_covers = lambda *a, **k: False
    try:
        with set_current_vllm_config(case.vc):
            drafts = s.propose(
                batch.input_batch(), md, slots, batch.last_hidden, batch.aux if case.eagle3 else None,
                batch.num_sampled, batch.num_rejected, batch.last_sampled, batch.next_prefill, batch.temperature,
                batch.seeds, **kw,
            )
    finally:
        del s._prefill
        del s.compute_draft_logits
        if vllm_prefill:
            del s._sp_covers
            del s._sp_decode_covers
    run.drafts = drafts.clone()
    run.returned = drafts
    run.kv = case.flat.clone()
    assert isinstance(drafts, torch.Tensor)
    return run


def draft_logits(case, hidden):
    """vLLM's draft logits (`compute_logits`: lm_head, EAGLE-3 scattered to target ids) of
    hidden rows, float32."""
    import torch

    from vllm.config import set_current_vllm_config

    with torch.inference_mode(), set_current_vllm_config(case.vc):
        return case.s.model.compute_logits(hidden).float()


def close(a, b, tol):
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() <= tol * (1.0 + b.abs().max().item())
