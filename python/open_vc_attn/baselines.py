"""open_vc_attn.baselines: the VC-Attention baseline on the GPU (docs/numerics.md section 7, docs/baselines.md).

VC-Attention = V-Smooth + ExpCast in natural key order: the value tokens of every (batch, head) are grouped
by k-means (64 clusters, 4 iterations, deterministic initialisation); a stable sort by cluster id gives a
permutation applied to K and V together (exact for non-causal attention); each 128-row block of the permuted
V is replaced by its BF16 mean plus an E4M3 residual with one scale per channel.

- :func:`vc_grouping` computes the permutation (int32 [B, H, Sk]); it can be reused on later denoising steps.
- :func:`prepare_vc` quantizes q, k, v for a permutation (computing one when none is given) into a
  :class:`PreparedVC`, which keeps the permutation for reuse.
- :func:`attention_vc` attends a :class:`PreparedVC`; :func:`vc_attention` does everything in one call.
- :func:`benchmark_vc` times the stages (grouping, fresh vs reused preparation, attention) for the benchmark.

Same conventions as :mod:`open_vc_attn.api`: torch CUDA tensors on a compute capability 9.0 GPU, head_dim
128, every kernel on ``torch.cuda.current_stream(device)`` with no host synchronization (except in
:func:`benchmark_vc`), custom ops ``torch.ops.open_vc_attn.{vc_grouping, prepare_vc, attention_vc_fp8}``
(:mod:`open_vc_attn.ops.vc`) so the functions trace under ``torch.compile``; bad arguments raise TypeError /
ValueError naming the argument. torch is imported when a function is called, not on import.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from . import _checks
from . import _checks_baselines

__all__ = ["PreparedVC", "vc_grouping", "prepare_vc", "attention_vc", "vc_attention", "benchmark_vc"]



@dataclasses.dataclass(frozen=True, eq=False)
class PreparedVC:
    """VC-prepared inputs (numerics section 7), contiguous tensors on one CUDA device.

    q_codes uint8 [B, Sq, H, D] (E4M3, original order), q_descale float32 [B, H, ceil(Sq/128)], k_codes
    uint8 [B, Sk, H, D] (K permuted, then quantized per 128-row block), k_descale float32 [B, H, ceil(Sk/128)],
    v_packed uint8 [B, H, D, ceil(Sk/128)*128] (residual codes of the permuted V, packed like
    PreparedFP8.v_packed), v_channel_descale float32 [B, H, D] (1 where a channel's residual is all zero),
    block_mean_scaled float32 [B, H, ceil(Sk/128), D] (BF16 block mean / v_channel_descale), permutation
    int32 [B, H, Sk] (entry i = original index of the key at position i; pass it to :func:`prepare_vc` to
    reuse the grouping). B is 1 for rank-3 inputs (``input_rank`` 3).
    """
    q_codes: Any
    q_descale: Any
    k_codes: Any
    k_descale: Any
    v_packed: Any
    v_channel_descale: Any
    block_mean_scaled: Any
    permutation: Any
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    input_rank: int
    dtype: Any

    @property
    def device(self):
        return self.q_codes.device

    def tensors(self) -> tuple:
        """The seven tensors in the argument order of ``torch.ops.open_vc_attn.attention_vc_fp8``."""
        return (self.q_codes, self.q_descale, self.k_codes, self.k_descale, self.v_packed, self.v_channel_descale,
                self.block_mean_scaled)


# ---- argument checking -------------------------------------------------------------------------------------

def _permutation4(permutation, k4, rank):
    """The permutation argument as an int32 [B, H, Sk] tensor, or None: None, a PreparedVC (its permutation
    is always [B, H, Sk]), or an int32 tensor [B, H, Sk] ([H, Sk] for rank-3 inputs)."""
    if permutation is None:
        return None
    torch = _checks.import_torch()
    if isinstance(permutation, PreparedVC):
        perm = permutation.permutation
    else:
        perm = permutation
        if rank == 3 and isinstance(perm, torch.Tensor):
            if perm.dim() != 2:
                raise ValueError(f"permutation: expected shape [H, Sk] for rank-3 inputs (from vc_grouping), got "
                                 f"{_checks.shape_of(perm)}")
            perm = perm.unsqueeze(0)
    _checks_baselines.check_permutation(perm, k4)
    return perm


def _check_prepared(prepared):
    _checks.require_instance(prepared, PreparedVC, "prepared", "a PreparedVC from open_vc_attn.baselines.prepare_vc")
    meta = _checks.prepared_meta(prepared)
    sizes = (meta["batch"], meta["seqlen_q"], meta["seqlen_k"], meta["heads"], meta["head_dim"])
    _checks_baselines.check_vc_tensors(prepared.tensors(), "prepared.", sizes)
    return meta


# ---- public functions --------------------------------------------------------------------------------------

def vc_grouping(v):
    """k-means grouping of the value tokens (section 7): int32 permutation [B, H, Sk] ([H, Sk] for a rank-3
    v); entry i of a row is the original index of the token placed at position i. Deterministic: the same
    v (and shape) always gives the same permutation. Not bit-identical to reference.vc_grouping (the GPU
    works in FP32 on the tensor cores, the reference in double), but the same method."""
    v4, rank = _checks_baselines.check_vc_v(v)
    from . import ops
    perm = ops.vc_grouping_op(v4)
    return perm[0] if rank == 3 else perm


def prepare_vc(q, k, v, permutation=None, *, qk_format="e4m3") -> PreparedVC:
    """Quantizes q, k, v for :func:`attention_vc` (section 7); bit-identical to reference.vc_prepare.

    q: [B, Sq, H, 128] or [Sq, H, 128]; k, v: [B, Sk, H, 128] (same conventions as api.prepare_fp8:
    bfloat16 or float16 CUDA tensors, head dim contiguous, other strides multiples of 8 elements).
    permutation: None (compute it with :func:`vc_grouping`), the int32 tensor [B, H, Sk] ([H, Sk] for
    rank-3 inputs) of an earlier grouping, or an earlier :class:`PreparedVC` whose grouping to reuse
    (later denoising steps: only the per-call preparation runs). Its values are read on the GPU only, so
    they are not checked: it must be a permutation of [0, Sk) per (batch, head). qk_format: "e4m3" only (the
    baseline's numerics, section 7): "int8" raises ValueError naming qk_format.
    """
    _checks.require_e4m3(_checks.qk_format(qk_format), "the VC baseline")
    q4, k4, v4, rank = _checks_baselines.check_vc_qkv(q, k, v)
    perm = _permutation4(permutation, k4, rank)
    from . import ops
    if perm is None:
        perm = ops.vc_grouping_op(v4)
    tensors = ops.prepare_vc_op(q4, k4, v4, perm)
    b, sq, h, d = (int(s) for s in q4.shape)
    return PreparedVC(*tensors, permutation=perm, batch=b, seqlen_q=sq, seqlen_k=int(k4.shape[1]), heads=h,
                      head_dim=d, input_rank=rank, dtype=q.dtype)


def _attend(tensors, rank, scale, want_lse):
    from . import ops
    out, lse = ops.attention_vc_fp8_op(*tensors, scale, want_lse)
    if rank == 3:   # one sequence: drop the batch axis again (views, no copy)
        out, lse = out[0], (lse[0] if want_lse else lse)
    return (out, lse) if want_lse else out


def attention_vc(prepared, *, softmax_scale=None, return_lse=False, p_format="expcast"):
    """VC-Attention on a :class:`PreparedVC`: ExpCast in natural key order, the block means restored through
    each key block's probability row sum. Returns out, bfloat16 in q's shape; with return_lse, (out, lse),
    lse float32 natural-log [B, H, Sq] ([H, Sq] for rank-3 inputs). The output is in the queries' original
    order (only the keys are permuted). p_format: "expcast" only ("exp2" raises ValueError naming p_format)."""
    _checks.require_expcast(_checks.p_format(p_format), "the VC baseline")
    scale, want_lse = _checks.softmax_scale(softmax_scale), _checks.return_lse(return_lse)
    meta = _check_prepared(prepared)
    return _attend(prepared.tensors(), meta["input_rank"], scale, want_lse)


def vc_attention(q, k, v, *, permutation=None, softmax_scale=None, return_lse=False, qk_format="e4m3",
                 p_format="expcast"):
    """:func:`prepare_vc` then :func:`attention_vc` (same arguments and results): group (unless a
    permutation or PreparedVC is given), prepare, attend. The intermediates are freed on return. Goes
    through the ops directly (no PreparedVC object), so ``torch.compile(fullgraph=True)`` traces it.
    qk_format: "e4m3" only ("int8" raises ValueError naming qk_format); p_format: "expcast" only ("exp2" raises
    ValueError naming p_format)."""
    _checks.require_e4m3(_checks.qk_format(qk_format), "the VC baseline")
    _checks.require_expcast(_checks.p_format(p_format), "the VC baseline")
    scale, want_lse = _checks.softmax_scale(softmax_scale), _checks.return_lse(return_lse)
    q4, k4, v4, rank = _checks_baselines.check_vc_qkv(q, k, v)
    perm = _permutation4(permutation, k4, rank)
    from . import ops
    if perm is None:
        perm = ops.vc_grouping_op(v4)
    return _attend(ops.prepare_vc_op(q4, k4, v4, perm), rank, scale, want_lse)


def benchmark_vc(q, k, v, *, softmax_scale=None, warmup=2, iters=10) -> dict:
    """Milliseconds per call (CUDA events, mean over `iters` after `warmup`) of the baseline's stages on
    these inputs: ``grouping_ms`` (vc_grouping), ``prepare_fresh_ms`` (grouping + preparation, the first
    denoising step), ``prepare_reused_ms`` (preparation with a reused permutation, later steps),
    ``attention_ms`` (attention_vc on a PreparedVC), and ``total_fresh_ms`` / ``total_reused_ms``
    (vc_attention without / with a permutation). Synchronizes the device; for benchmarks only."""
    torch = _checks.import_torch()
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
    if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 1:
        raise ValueError(f"iters: expected an int >= 1, got {iters!r}")
    _checks_baselines.check_vc_qkv(q, k, v)

    from .bench import harness

    def timed(fn):
        for _ in range(warmup):
            fn()
        return harness.eager_ms(fn, iters)

    with torch.inference_mode(), torch.cuda.device(q.device):
        perm = vc_grouping(v)
        prepared = prepare_vc(q, k, v, perm)
        return {
            "grouping_ms": timed(lambda: vc_grouping(v)),
            "prepare_fresh_ms": timed(lambda: prepare_vc(q, k, v)),
            "prepare_reused_ms": timed(lambda: prepare_vc(q, k, v, perm)),
            "attention_ms": timed(lambda: attention_vc(prepared, softmax_scale=softmax_scale)),
            "total_fresh_ms": timed(lambda: vc_attention(q, k, v, softmax_scale=softmax_scale)),
            "total_reused_ms": timed(lambda: vc_attention(q, k, v, permutation=perm, softmax_scale=softmax_scale)),
        }
