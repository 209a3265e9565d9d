"""SGLang 0.5.23's own objects, built for a test on CPU (or CUDA) tensors: the published
server arguments, a tiny EAGLE-1 / EAGLE-3 draft model (`LlamaForCausalLMEagle[3]`, random
weights), its `ModelRunner` (no `__init__`, as SGLang's own attention test kit does), the
`ReqToTokenPool` and `MHATokenToKVPool`, an `EagleDraftWorker` (no `__init__`: the fields
`_draft_extend_for_decode` reads), and the `ScheduleBatch` / `GenerationBatchResult` verify
leaves behind. Nothing of SGLang's logic is patched: the tests call the release's
`EagleDraftWorker._draft_extend_for_decode`, `prepare_for_draft_extend`, `ForwardBatch`,
the torch-native attention backend and the model forward as they are.
"""

import contextlib
import json
import os
import socket
import tempfile
import types

import cuda_stubs

STUBS = cuda_stubs.install_sglang_stubs()

import torch  # noqa: E402

from sglang.srt.runtime_context import SpawnRanks, get_parallel, get_server_args, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

_DIST = {"done": False}


def publish_args(*, algo="EAGLE", steps=3, topk=1, ndraft=4, page_size=1, device="cpu", **extra):
    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig

    sa = ServerArgs(
        model_path="dummy",
        device=device,
        page_size=page_size,
        speculative_algorithm=algo,
        speculative_draft_model_path="dummy-draft",
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndraft,
        attention_backend="torch_native",
        disable_cuda_graph=True,
        cuda_graph_config=CudaGraphConfig(
            decode=PhaseConfig(backend=Backend.DISABLED, bs=[1, 2, 4]),
            prefill=PhaseConfig(backend=Backend.DISABLED),
        ),
        **extra,
    )
    reset_context()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    if _DIST["done"]:
        # reset_context() forgets the process groups: state the built ones again.
        from sglang.srt.distributed import parallel_state as ps

        built = {
            "world_group": ps._WORLD, "tp_group": ps._TP, "pp_group": ps._PP, "moe_ep_group": ps._MOE_EP,
            "moe_dp_group": ps._MOE_DP, "moe_tp_group": ps._MOE_TP, "attn_tp_group": ps._ATTN_TP,
            "attn_cp_group": ps._ATTN_CP, "shared_experts_tp_group": ps._SHARED_EXPERTS_TP, "dcp_group": ps._DCP,
        }
        get_parallel().override_permanently(**{k: v for k, v in built.items() if v is not None})
    return sa


def init_dist():
    """One-rank gloo process groups (the draft models read the TP and PP groups)."""
    if _DIST["done"]:
        return
    from sglang.srt.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )
    ps.initialize_model_parallel()
    _DIST["done"] = True


def write_config(*, eagle3, vocab=256, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, ctx=128,
                 draft_vocab=None, bias=False):
    """A tiny draft head's config.json (what both SGLang and `specplan compile --hf-config` read)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": ctx, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if eagle3:
        # transformers 5.19 needs the key present (None: the target vocabulary).
        cfg["draft_vocab_size"] = draft_vocab
    if bias:
        cfg["bias"] = True
    d = tempfile.mkdtemp(prefix="sglang-draft-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def model_config(path, *, eagle3):
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=path, is_draft_model=True, dtype="bfloat16",
                       speculative_algorithm="EAGLE3" if eagle3 else "EAGLE")


def build_model(mc, *, eagle3, device="cpu", seed=0):
    """The release's draft model class on random weights (norms near 1, attention biases
    zero as a checkpoint without them leaves them)."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    if eagle3:
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as Cls
    else:
        from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle as Cls
    init_dist()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device):
            m = Cls(mc.hf_config)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator().manual_seed(seed)
    for n, p in m.named_parameters():
        if n.endswith("norm.weight"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif n.endswith("self_attn.qkv_proj.bias") or n.endswith("self_attn.o_proj.bias"):
            val = torch.zeros(p.shape)
        else:
            val = 0.08 * torch.randn(p.shape, generator=g)
        p.data.copy_(val.to(p.dtype))
    m.shared_experts_config = SharedExpertsConfig()
    m.eval()
    return m


def make_pools(*, max_reqs, ctx, kv_heads, head_dim, dtype, page_size=1, hnd=False, device="cpu"):
    """`ReqToTokenPool` and a one-layer `MHATokenToKVPool` (HND when `hnd`: SGLang reads
    SGLANG_USE_HND_KVCACHE when the pool is built)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    r2t = ReqToTokenPool(size=max_reqs, max_context_len=ctx, device=device, enable_memory_saver=False)
    old = os.environ.get("SGLANG_USE_HND_KVCACHE")
    os.environ["SGLANG_USE_HND_KVCACHE"] = "1" if hnd else "0"
    try:
        size = ((max_reqs * ctx + page_size - 1) // page_size) * page_size
        kv = MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype, head_num=kv_heads, head_dim=head_dim,
                              layer_num=1, device=device, enable_memory_saver=False, enable_alt_stream=False)
    finally:
        if old is None:
            del os.environ["SGLANG_USE_HND_KVCACHE"]
        else:
            os.environ["SGLANG_USE_HND_KVCACHE"] = old
    return r2t, kv


def draft_runner(mc, r2t, kv, *, model, page_size, algo, device="cpu"):
    """The draft `ModelRunner` with what prepare, `ForwardBatch.init_new` and the eager
    forward read."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    mr = object.__new__(ModelRunner)
    mr.device, mr.gpu_id = device, 0
    mr.dtype = mr.kv_cache_dtype = mc.dtype
    mr.model_config = mc
    mr.is_draft_worker = True
    mr.spec_algorithm = algo
    mr.page_size = page_size
    mr.req_to_token_pool, mr.token_to_kv_pool = r2t, kv
    mr.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=page_size, get_kvcache=lambda: kv)
    mr.prefill_attention_backend_str = mr.decode_attention_backend_str = "torch_native"
    mr.canary_manager = mr.lora_manager = mr.watermark_state = mr.device_timer = None
    mr.ngram_embedding_manager = types.SimpleNamespace(enabled=False)
    mr.shared_read_done_event = None
    mr.model = model
    mr.init_kv_index_translator()
    mr.forward_pass_id = 0
    mr.msprobe_debugger = mr.eplb_manager = mr.hisparse_coordinator = None
    mr.decode_cuda_graph_runner = mr.prefill_cuda_graph_runner = None
    mr.enable_elastic_ep = False
    mr.pp_group = ps.get_pp_group()
    mr.server_args = get_server_args()
    mr.max_running_requests = r2t.size
    mr.max_total_num_tokens = kv.size
    mr.is_generation, mr.support_pp, mr._kernel_warmed_up = True, False, True
    mr.attn_backend = TorchNativeAttnBackend(mr)
    mr.eager_runner = EagerRunner(mr, run_warmup=False)
    return mr


def draft_worker(dr, r2t, *, topk, steps, ndraft, algo, hot_token_id, device="cpu"):
    """An `EagleDraftWorker` with the fields `_draft_extend_for_decode` reads, set by the
    release's own helpers where it has them."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    w = object.__new__(EagleDraftWorker)
    w.device = device
    w.topk, w.speculative_num_steps, w.speculative_num_draft_tokens = topk, steps, ndraft
    w.speculative_algorithm = algo
    w.draft_runner, w.req_to_token_pool = dr, r2t
    w.hot_token_id = hot_token_id
    w.plan_stream, w.plan_stream_ctx = None, contextlib.nullcontext()
    w.cuda_graph_runner = None
    w.cuda_graph_runner_for_draft_extend = None
    w.dsa_extend_topk_buf = None
    w.server_args = get_server_args()
    EagleDraftWorker._rebuild_topk1_chain_buffers(w)
    EagleDraftWorker._init_dsa_index_share_state(w)
    return w


class _Req:
    def __init__(self, i):
        self.rid, self.lora_id, self.token_type_ids = f"r{i}", None, None


def verify_state(*, L, N, accept, vocab, h_in, dtype, r2t, mc, seed, host_lens=True, device="cpu", page_size=1):
    """The `ScheduleBatch` and `GenerationBatchResult` target verification leaves: rows
    1..bs of `req_to_token` filled with distinct slots (whole pages of a shuffled page
    order, as SGLang's allocator hands them out), the verify window's ids, accept lengths,
    the target's hidden states."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    g = torch.Generator().manual_seed(seed)
    bs = len(L)
    rows = torch.arange(1, bs + 1, dtype=torch.int64)
    pages_per_req = [(l + N + page_size - 1) // page_size for l in L]
    order = torch.randperm(sum(pages_per_req), generator=g) + 1  # page 0 absorbs padding writes
    at = 0
    for row, l, np_ in zip(rows.tolist(), L, pages_per_req):
        pages = order[at:at + np_]
        at += np_
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[: l + N]
        r2t.req_to_token[row, : l + N] = slots.to(torch.int32).to(r2t.req_to_token.device)
    seq_lens = torch.tensor(L, dtype=torch.int64)
    out_cache_loc = torch.cat([r2t.req_to_token[row, l:l + N].to(torch.int64) for row, l in zip(rows.tolist(), L)])
    accept_lens = torch.tensor(accept, dtype=torch.int32)
    predict = torch.randint(0, vocab, (bs * N,), generator=g, dtype=torch.int64).to(torch.int32)
    hidden = torch.randn(bs * N, h_in, generator=g).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    batch = ScheduleBatch(
        reqs=[_Req(i) for i in range(bs)], req_to_token_pool=r2t, model_config=mc, device=device,
        forward_mode=ForwardMode.TARGET_VERIFY, spec_algorithm=SpeculativeAlgorithm.EAGLE,
        input_ids=dev(predict.clone()), req_pool_indices=dev(rows), seq_lens=dev(seq_lens),
        seq_lens_cpu=seq_lens.clone() if host_lens else None, seq_lens_sum=int(sum(L)),
        out_cache_loc=dev(out_cache_loc), multimodal_inputs=[None] * bs, sampling_info=None, return_logprob=False,
    )
    result = GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=dev(hidden)),
        next_token_ids=dev(predict), accept_lens=dev(accept_lens), new_seq_lens=dev(seq_lens + accept_lens),
        next_draft_input=EagleDraftInput(bonus_tokens=dev(torch.zeros(bs, dtype=torch.int32))),
        speculative_num_draft_tokens=N,
    )
    return batch, result


def fill_prefix(kv, r2t, rows, L, seed=7):
    """Random K/V at every request's prefix slots (what earlier steps wrote), written where
    the pool's layout keeps them."""
    g = torch.Generator().manual_seed(seed)
    k, v = kv.k_buffer[0], kv.v_buffer[0]
    heads, d = kv.head_num, kv.head_dim
    for row, l in zip(rows, L):
        s = r2t.req_to_token[row, :l].long().to(k.device)
        nk = torch.randn(l, heads, d, generator=g).to(k.dtype).to(k.device)
        nv = torch.randn(l, heads, d, generator=g).to(v.dtype).to(v.device)
        if k.dim() == 3:
            k[s], v[s] = nk, nv
        else:
            p = kv.page_size
            k[s // p, :, s % p, :], v[s // p, :, s % p, :] = nk, nv


def slot_kv(kv, slots):
    """K and V of token slots `[n, H, D]` (NHD or HND pools)."""
    k, v = kv.k_buffer[0], kv.v_buffer[0]
    s = slots.long().to(k.device)
    if k.dim() == 3:
        return k[s], v[s]
    p = kv.page_size
    return k[s // p, :, s % p, :], v[s // p, :, s % p, :]


def slot_kv_of(buf, kv, slots):
    """Rows of token slots `[n, H, D]` of one pool tensor (a snapshot of K or V)."""
    s = slots.long().to(buf.device)
    if buf.dim() == 3:
        return buf[s]
    p = kv.page_size
    return buf[s // p, :, s % p, :]
