"""No host synchronization inside libopenvc: every call form captured in a CUDA graph in global capture mode.

The `test_no_host_synchronization` tests (test_gpu_api.py, test_gpu_general.py, test_gpu_vc.py) run a call
under torch.cuda.set_sync_debug_mode("error"), which sees torch's own calls only: libopenvc links the CUDA
runtime statically, so a cudaStreamSynchronize, cudaDeviceSynchronize, synchronous cudaMemcpy or cudaMalloc
inside it would pass there unseen. Here each call form is captured with
torch.cuda.graph(g, capture_error_mode="global"): during such a capture the CUDA driver refuses those calls
from any caller in the process and invalidates the capture, so the capture fails. The graph is then replayed
with new inputs (values, offsets, key counts) and compared byte for byte with eager calls
(helpers.graph_replays_like_eager). test_global_capture_sees_a_synchronization_outside_torch checks the
mechanism itself on this machine: a driver synchronization made through ctypes, not through torch, is
refused and fails the capture.

Covered: open_vc_attn.attention (dense, causal, cross lengths, head_dim 64, FP16 out, key counts, packed
sequences with and without key counts, INT8 with K smoothing and exp2 P, LSE, MQA), prepare_fp8 + attention_fp8
(batched, packed with key counts, INT8, MQA), the general path's op, V residual repair and the VC baseline (whose
test files capture them too). Tests marked `gpu` need torch and an sm_90 device (conftest.py skips them
otherwise). On an H200: python3 -m pytest -q -rs tests/python/test_gpu_capture.py
"""
import subprocess
import sys
import textwrap

import pytest

import open_vc_attn
from helpers import graph_replays_like_eager, torch_qkv

pytestmark = pytest.mark.gpu

B, S, SK, H = 2, 1000, 900, 2   # batched calls: [B, S, H, D] q and k, v (cross-length calls take S - 300 queries)
TOTAL_Q, TOTAL_K = 1000, 900     # packed calls: three sequences each, offsets change between replays
CU_Q = ([0, 1, 300, 1000], [0, 500, 500, 1000])     # lengths 1, 299, 700 / 500, 0, 500: at most 700
CU_K = ([0, 400, 400, 900], [0, 1, 600, 900])       # lengths 400, 0, 500 / 1, 599, 300: at most 600
MAX_Q, MAX_K = 700, 600
USED_BATCHED = ([1000, 333], [17, 999])             # key counts per batch entry (1000 > SK: clamped)
USED_PACKED = ([400, 0, 250], [1, 300, 300])        # key counts per sequence (clamped to each length)


def _int32(torch, values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def batched(torch, seed, dtype="bfloat16", counts=False):
    """Input sets (q, k, v[, seqused_k]) of two seeds: k and v hold SK keys, q S queries."""
    sets = []
    for i in range(2):
        q, _, _ = torch_qkv(torch, B, S, H, dtype=dtype, seed=seed + 2 * i)
        _, k, v = torch_qkv(torch, B, SK, H, dtype=dtype, seed=seed + 2 * i + 1)
        sets.append((q, k, v, _int32(torch, USED_BATCHED[i])) if counts else (q, k, v))
    return sets


def packed(torch, seed, counts=False):
    """Input sets (q, k, v, cu_seqlens_q, cu_seqlens_k[, seqused_k]) of two seeds and two offset sets."""
    sets = []
    for i in range(2):
        q = torch_qkv(torch, 1, TOTAL_Q, H, seed=seed + 2 * i)[0][0]
        _, k, v = (x[0] for x in torch_qkv(torch, 1, TOTAL_K, H, seed=seed + 2 * i + 1))
        offsets = (_int32(torch, CU_Q[i]), _int32(torch, CU_K[i]))
        sets.append((q, k, v, *offsets, _int32(torch, USED_PACKED[i])) if counts else (q, k, v, *offsets))
    return sets


def _varlen(cq, ck):
    return dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K)


# ---- open_vc_attn.attention: one call from q, k, v -----------------------------------------------------------

def _attention(**kw):
    return lambda q, k, v: open_vc_attn.attention(q, k, v, **kw)


def _float16_out(q, k, v):
    import torch
    return open_vc_attn.attention(q, k, v, causal=True, out_dtype=torch.float16)


ATTENTION = {   # name: (call, input sets)
    "dense_lse": (_attention(return_lse=True), lambda t: batched(t, 10)),
    "causal_cross_lse": (lambda q, k, v: open_vc_attn.attention(q[:, :S - 300], k, v, causal=True, return_lse=True),
                         lambda t: batched(t, 20)),
    "head_dim_64_causal": (lambda q, k, v: open_vc_attn.attention(q[..., :64], k[..., :64], v[..., :64], causal=True,
                                                                  return_lse=True), lambda t: batched(t, 30)),
    "float16_out": (_float16_out, lambda t: batched(t, 40, dtype="float16")),
    "key_counts_lse": (lambda q, k, v, used: open_vc_attn.attention(q, k, v, seqused_k=used, return_lse=True),
                       lambda t: batched(t, 50, counts=True)),
    "key_counts_causal": (lambda q, k, v, used: open_vc_attn.attention(q, k, v, seqused_k=used, causal=True),
                          lambda t: batched(t, 60, counts=True)),
    "packed_causal_lse": (lambda q, k, v, cq, ck: open_vc_attn.attention(q, k, v, causal=True, return_lse=True,
                                                                         **_varlen(cq, ck)),
                          lambda t: packed(t, 70)),
    "packed_key_counts": (lambda q, k, v, cq, ck, used: open_vc_attn.attention(q, k, v, seqused_k=used,
                                                                               **_varlen(cq, ck)),
                          lambda t: packed(t, 80, counts=True)),
    "int8_smoothing": (_attention(qk_format="int8", k_smoothing=True), lambda t: batched(t, 90)),
    "int8_smoothing_causal_lse": (_attention(qk_format="int8", k_smoothing=True, causal=True, return_lse=True),
                                  lambda t: batched(t, 100)),
    "int8_smoothing_exp2_key_counts": (
        lambda q, k, v, used: open_vc_attn.attention(q, k, v, seqused_k=used, qk_format="int8", k_smoothing=True,
                                                     p_format="exp2"),
        lambda t: batched(t, 110, counts=True)),
    "int8_packed_lse": (lambda q, k, v, cq, ck: open_vc_attn.attention(q, k, v, qk_format="int8", return_lse=True,
                                                                       **_varlen(cq, ck)),
                        lambda t: packed(t, 120)),
    # GQA / MQA: one K/V head (a view of head 0) for the two query heads
    "mqa_causal_lse": (lambda q, k, v: open_vc_attn.attention(q, k[:, :, :1], v[:, :, :1], causal=True,
                                                              return_lse=True), lambda t: batched(t, 130)),
    "mqa_int8_smoothing_packed": (lambda q, k, v, cq, ck: open_vc_attn.attention(
        q, k[:, :1], v[:, :1], qk_format="int8", k_smoothing=True, return_lse=True, **_varlen(cq, ck)),
        lambda t: packed(t, 140)),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_captures_in_global_mode(torch, name):
    call, inputs = ATTENTION[name]
    graph_replays_like_eager(torch, call, *inputs(torch))


# ---- prepare_fp8 + attention_fp8, the general path's op ---------------------------------------------------------

def _prepared_batched(q, k, v):
    """A batched preparation (every byte of it is written: compared too) attended three ways."""
    p = open_vc_attn.prepare_fp8(q, k, v)
    out, lse = open_vc_attn.attention_fp8(p, return_lse=True)
    return (*p.tensors(), out, lse, open_vc_attn.attention_fp8(p, causal=True, mid_window_blocks=None))


def _prepared_packed_key_counts(q, k, v, cq, ck, used):
    # Codes past a key count are not written (never read): only the attention outputs are compared.
    p = open_vc_attn.prepare_fp8(q, k, v, cq, ck, MAX_Q, MAX_K, seqused_k=used)
    return open_vc_attn.attention_fp8(p, causal=True, return_lse=True)


def _prepared_int8(q, k, v):
    p = open_vc_attn.prepare_fp8(q, k, v, qk_format="int8", k_smoothing=True)
    return (*p.tensors(), open_vc_attn.attention_fp8(p, p_format="exp2"), open_vc_attn.attention_fp8(p, causal=True))


def _general_batched(q, k, v):
    from open_vc_attn import ops
    p = open_vc_attn.prepare_fp8(q[..., :64], k[..., :64], v[..., :64])
    return ops.attention_fp8_op(*p.tensors(), None, None, 0, 0, 0.0, True, 4, True, path="general")


def _general_packed(q, k, v, cq, ck):
    from open_vc_attn import ops
    p = open_vc_attn.prepare_fp8(q, k, v, cq, ck, MAX_Q, MAX_K)
    return ops.attention_fp8_op(*p.tensors(), cq, ck, MAX_Q, MAX_K, 0.0, False, 4, True, path="general")


PREPARED = {
    "batched": (_prepared_batched, lambda t: batched(t, 200)),
    "packed_key_counts": (_prepared_packed_key_counts, lambda t: packed(t, 210, counts=True)),
    "int8_smoothing_exp2": (_prepared_int8, lambda t: batched(t, 220)),
    "general_batched_causal": (_general_batched, lambda t: batched(t, 230)),
    "general_packed": (_general_packed, lambda t: packed(t, 240)),
    "mqa_batched": (lambda q, k, v: _prepared_batched(q, k[:, :, :1], v[:, :, :1]), lambda t: batched(t, 250)),
}


@pytest.mark.parametrize("name", sorted(PREPARED))
def test_prepare_and_attention_fp8_capture_in_global_mode(torch, name):
    call, inputs = PREPARED[name]
    graph_replays_like_eager(torch, call, *inputs(torch))


# ---- V residual repair and the VC baseline ------------------------------------------------------------------

@pytest.mark.parametrize("b,s,h", [(1, S, H), (2, 256, 260)])
def test_repair_captures_in_global_mode(torch, b, s, h):
    """prepare_v_repair (energy selection: preparation, energy, radix select, sort of the winners, rows) and
    attention_v_repair in one graph. 2 x 260 = 520 (batch, head) segments: CUB's segmented *sort*
    synchronizes above 500 segments, the segmented radix sort the library uses must not
    (docs/architecture.md)."""
    from open_vc_attn import repair

    def call(q, k, v):
        pr = repair.prepare_v_repair(q, k, v, 0.05)
        return (*pr.tensors(), *repair.attention_v_repair(pr, return_lse=True))
    sets = [torch_qkv(torch, b, s, h, seed=seed) for seed in (300, 301)]
    graph_replays_like_eager(torch, call, *sets)


def test_vc_baseline_captures_in_global_mode(torch):
    """vc_attention: k-means grouping, preparation and attention in one graph."""
    from open_vc_attn import baselines
    sets = [torch_qkv(torch, 1, 700, H, seed=s) for s in (310, 311)]
    graph_replays_like_eager(torch, lambda q, k, v: baselines.vc_attention(q, k, v, return_lse=True), *sets)


# ---- the mechanism: global capture sees a CUDA call that torch did not make -------------------------------------

_OUTSIDE_TORCH = textwrap.dedent("""
    import ctypes, torch
    cuda = ctypes.CDLL("libcuda.so.1")   # the driver API, as a statically linked runtime reaches it
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    before = cuda.cuCtxSynchronize()     # 0: the primary context is current on this thread
    graph, during, capture = torch.cuda.CUDAGraph(), None, "ok"
    try:
        with torch.cuda.graph(graph, capture_error_mode="global"):
            y = x * 2
            during = cuda.cuCtxSynchronize()
    except RuntimeError as exc:
        capture = "failed: " + str(exc).splitlines()[0]
    print(before, during, capture, sep="|")
""")


def test_global_capture_sees_a_synchronization_outside_torch():
    """The premise of this file, on this machine's driver: a synchronization that does not go through torch
    (cuCtxSynchronize through ctypes) is refused during a global-mode capture, and the capture fails. In a
    subprocess: a failed capture leaves torch's capture stream current in that process."""
    res = subprocess.run([sys.executable, "-c", _OUTSIDE_TORCH], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    before, during, capture = res.stdout.strip().splitlines()[-1].split("|", 2)
    assert before == "0", res.stdout
    assert during not in ("0", "None"), f"cuCtxSynchronize returned {during} during the capture"
    assert capture.startswith("failed"), f"the capture did not fail: {res.stdout}"
