"""GPU API of open_vc_attn: FP8 ExpCast attention on torch CUDA tensors (Hopper, sm_90a only).

- :func:`prepare_fp8` quantizes BF16/FP16 ``q, k, v`` into a :class:`PreparedFP8` (E4M3 codes, descales,
  packed V; docs/numerics.md section 1), batched ``[B, S, H, D]`` or packed variable-length sequences
  (``cu_seqlens_q/k``). ``qk_format="int8"`` quantizes Q and K to INT8 instead (one Q descale per row, one K
  descale per 16-key group; numerics section 9), and ``k_smoothing=True`` subtracts each K channel's mean
  over the sequence first (either format); V is E4M3 either way. ``p_format`` (an attention option of
  :func:`attention` and :func:`attention_fp8`) picks P's code: "expcast" (default) or "exp2", E4M3 of an
  exponential (exact for keys 0-63 of each 128-key block, within one step for the others), with INT8 Q/K
  (numerics, "P format").
- :meth:`PreparedFP8.from_quantized` wraps tensors that were quantized elsewhere (e.g. prepared before a
  sequence-parallel all-to-all) after checking their dtypes, shapes, layout and device.
- :func:`attention_fp8` runs ExpCast attention on a :class:`PreparedFP8` (sections 2-5): BF16 output of
  q's shape, optionally the natural-log LSE, optionally causal.
- :func:`attention` does both in one call, for batched or packed (cu_seqlens) inputs, causal or not, with
  key padding masks or key counts, head_dim 128 or 64; ``version="reference", mode="bf16"`` runs torch
  SDPA in BF16 instead (A/B runs).
- Grouped-query attention (GQA / MQA) in all three: k and v may hold Hk heads where q holds H, H a multiple of
  Hk; query head h attends K/V head h // (H // Hk), bit for bit as attention on k and v with each head repeated
  H // Hk times (``k.repeat_interleave(H // Hk, dim=-2)``): K and V are quantized per K/V head. The sm_90a fast
  path only: a call past its range raises ValueError naming k (:mod:`._gqa`).

Two kernels sit behind these, with the same numerics contract: the sm_90a fast path (head_dim 128 and
64: dense, causal, packed sequences, key counts) and the general path on the CUDA cores (sizes past the
fast path's 32-bit range), which is correct but far slower (not measured side by side): a call that lands
there warns once per process and reason (``open_vc_attn.PerformanceWarning``, a RuntimeWarning). So does a fast-path
call with at most 256 keys per sequence, where torch's own attention measured faster (:mod:`._perf_warnings`).
docs/api.md lists which call takes which path.

torch is imported inside the functions only, so ``import open_vc_attn`` stays torch-free. Every kernel is
enqueued on ``torch.cuda.current_stream(device)`` with no host synchronization and no device-to-host
copy (one exception, documented: packed sequences without max_seqlen_q/k), so the calls can be captured
in a CUDA graph; the GPU work goes through custom ops (:mod:`open_vc_attn.ops`), which makes the functions
traceable by ``torch.compile(fullgraph=True)``. The library is inference-only: tensors that require grad
are rejected. A bad argument raises TypeError (wrong kind) or ValueError (wrong value) whose message
starts with the argument's name; a GPU other than compute capability 9.0 raises RuntimeError.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import _checks, _gqa
from ._layout import DEFAULT_MID_WINDOW_BLOCKS
from ._perf_warnings import warn_after_call

__all__ = ["PreparedFP8", "prepare_fp8", "attention_fp8", "attention"]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedFP8:
    """Prepared FP8 inputs (docs/numerics.md section 1), all contiguous tensors on one CUDA device.

    q_codes uint8 [B, Sq, H, D] (E4M3), q_descale float32 [B, H, ceil(Sq/128)], k_codes uint8
    [B, Sk, H, D], k_descale float32 [B, H, ceil(Sk/128)], v_packed uint8 [B, H, D, ceil(Sk/128)*128]
    (keys permuted per 16-key group, see ``_openvc_ext.PACKED_KEY_ORDER``), v_descale float32 [B, H].
    B is 1 for a rank-3 input (``input_rank`` 3); ``dtype`` is the torch dtype of the inputs; D is 128 or 64.
    Reusable: several :func:`attention_fp8` calls may share one preparation.

    ``qk_format`` "int8" (numerics section 9): q_codes and k_codes are torch.int8 INT8 codes, q_descale
    float32 [B, H, Sq] (one per query row) and k_descale float32 [B, H, ceil(Sk/128), 8] (one per 16-key group
    g of each 128-key block: key c of a block is in group ((c mod 8) // 2) + 4 * (c // 64); groups without a
    valid key 0); V as for E4M3. Packed: q_descale [N, H, max_q] (0 past a sequence's end) and k_descale
    [N, H, ceil(max_k/128), 8]. ``k_smoothing`` records that K minus its per-(sequence, head) channel mean was
    quantized (softmax is invariant to that shift); it changes no layout. :func:`attention_fp8` reads the
    format from here.

    Packed variable-length sequences (``is_varlen``: prepare_fp8 with cu_seqlens): ``cu_seqlens_q/k`` are
    the caller's int32 offset tensors, batch is the sequence count N, seqlen_q/seqlen_k the max_seqlen_q/k
    given, input_rank 3, and the tensors are q_codes [total_q, H, D], q_descale [N, H, ceil(max_q/128)],
    k_codes [total_k, H, D], k_descale [N, H, ceil(max_k/128)] (0 past a sequence's end), v_packed
    [N, H, D, ceil(max_k/128)*128] (each sequence from column 0 of its own slab, zero padding) and
    v_descale [N, H]. :func:`attention_fp8` attends them (as :func:`attention` with cu_seqlens does).

    GQA / MQA (a preparation of k and v with Hk heads, a divisor of H): k_codes, k_descale, v_packed and v_descale
    hold Hk heads where the layouts above say H (the K/V side: [B, Sk, Hk, D], [B, Hk, ...]; packed likewise);
    q_codes and q_descale keep H. ``heads`` is H, :attr:`kv_heads` Hk (read from k_codes).
    """
    q_codes: Any
    q_descale: Any
    k_codes: Any
    k_descale: Any
    v_packed: Any
    v_descale: Any
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    input_rank: int
    dtype: Any
    cu_seqlens_q: Any = None   # packed sequences only (int32 CUDA tensors of N + 1 offsets)
    cu_seqlens_k: Any = None
    seqused_k: Any = None      # optional int32 key counts per batch entry / sequence (key padding)
    qk_format: str = "e4m3"    # Q/K codes: "e4m3" (uint8 E4M3 bytes) or "int8" (torch.int8; layouts above)
    k_smoothing: bool = False  # K's per-channel mean was subtracted before quantization

    @property
    def device(self):
        return self.q_codes.device

    @property
    def kv_heads(self) -> int:
        """The K/V head count Hk (k_codes' head dim): ``heads``, or a divisor of it for a GQA / MQA preparation."""
        return int(self.k_codes.shape[-2])

    @property
    def is_varlen(self) -> bool:
        """True for a preparation of packed variable-length sequences (cu_seqlens)."""
        return self.cu_seqlens_q is not None or self.cu_seqlens_k is not None

    def tensors(self) -> tuple:
        """The six tensors in the argument order of ``torch.ops.open_vc_attn.attention_fp8``."""
        return (self.q_codes, self.q_descale, self.k_codes, self.k_descale, self.v_packed, self.v_descale)

    @classmethod
    def from_quantized(cls, q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, *, input_rank=4,
                       dtype=None, qk_format="e4m3", k_smoothing=False) -> "PreparedFP8":
        """A :class:`PreparedFP8` over tensors quantized elsewhere (for instance by :func:`prepare_fp8` on
        another rank, before a sequence-parallel all-to-all), for :func:`attention_fp8`.

        input_rank 4: q_codes [B, Sq, H, D], q_descale [B, H, ceil(Sq/128)], k_codes [B, Sk, H, D],
        k_descale [B, H, ceil(Sk/128)], v_packed [B, H, D, ceil(Sk/128)*128], v_descale [B, H].
        input_rank 3 (one sequence; attention_fp8 then returns [Sq, H, D]): the same without the B axis. Codes are
        torch.uint8 or torch.float8_e4m3fn (E4M3 bytes), descales torch.float32; every tensor contiguous, on one
        CUDA device. GQA / MQA: k_codes [B, Sk, Hk, D] with Hk a divisor of H, and k_descale, v_packed, v_descale of
        Hk heads (ValueError naming k_codes for an Hk that does not divide H). v_packed must be in the packed layout
        of prepare_fp8 (per head, dims by keys, keys permuted inside each 16-key group by
        ``_openvc_ext.PACKED_KEY_ORDER``, zero padding), not token-major V codes. ``dtype`` (torch.bfloat16 or
        torch.float16, default bfloat16) records the dtype the inputs had; it does not change the results. Nothing
        is copied: the result holds uint8 views of the given tensors. B, Sq, Sk, H, D are read from q_codes and
        k_codes; a bad argument raises TypeError / ValueError naming it and what was expected.

        qk_format="int8": q_codes and k_codes are torch.int8, q_descale [B, H, Sq] and k_descale
        [B, H, ceil(Sk/128), 8] (the INT8 layouts of :class:`PreparedFP8`; the result keeps the int8 tensors).
        k_smoothing records whether K was smoothed before quantization (no effect on the attention).
        """
        tensors, fields = _checks.check_quantized((q_codes, q_descale, k_codes, k_descale, v_packed, v_descale),
                                                  input_rank, dtype, qk_format, k_smoothing)
        return cls(*tensors, **fields)


def _max_seqlen(given, cu):
    """max_seqlen_q/k: the given value, or the longest sequence read from the offsets (one device-to-host
    copy, i.e. a synchronization; documented) when it is None and cu is a usable offset tensor. Anything
    unusable is left to the op's checks (_checks.check_varlen), which name it."""
    torch = _checks.import_torch()
    if given is not None or not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2 \
            or cu.dtype != torch.int32:
        return given
    return max(1, int((cu[1:] - cu[:-1]).max()))


def _finish(out, lse, rank, return_lse):
    """The call's result: rank 3 (one sequence) drops the batch axis again (views, no copy)."""
    if rank == 3:
        out, lse = out[0], (lse[0] if return_lse else lse)
    return (out, lse) if return_lse else out


def _cast_out(res, out_dtype):
    """The BF16 reference's output in out_dtype (it computes in BF16 through SDPA)."""
    if out_dtype is None:
        return res
    if isinstance(res, tuple):
        return (res[0].to(out_dtype), res[1])
    return res.to(out_dtype)


# ---- public functions ---------------------------------------------------------------------------------

def prepare_fp8(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                seqused_k=None, qk_format="e4m3", k_smoothing=False) -> PreparedFP8:
    """Quantizes ``q, k, v`` for :func:`attention_fp8` (docs/numerics.md section 1).

    q: [B, Sq, H, D] or [Sq, H, D] (one sequence); k, v: [B, Sk, Hk, D] (or [Sk, Hk, D] with a rank-3 q), Hk = H
    or a divisor of it (GQA / MQA: the K/V outputs hold Hk heads, each K/V head quantized once, as each of its
    repeated copies would be; ValueError naming k otherwise, or where attention_fp8 could not attend it: past the
    fast path's range). bfloat16 or float16 CUDA tensors of one dtype and device; D 128 or 64. The head dim must be
    contiguous; the other strides may be anything that is a multiple of 8 elements, and the data
    16-byte aligned (nothing is copied to fix a layout). The outputs are new tensors.

    Packed variable-length sequences: q [total_q, H, D], k and v [total_k, Hk, D], with cu_seqlens_q and
    cu_seqlens_k int32 CUDA tensors of N + 1 offsets (cu[0] = 0, non-decreasing, cu[N] <= total) and
    max_seqlen_q / max_seqlen_k Python ints >= every sequence's length (an upper bound is fine). The offsets
    are read on the GPU only (no synchronization: their values are not checked). Each sequence is quantized
    separately; see :class:`PreparedFP8` for the output layout.

    seqused_k: optional int32 CUDA tensor of key counts, one per batch entry (or sequence): entry b uses
    its first seqused_k[b] keys (clamped to [0, Sk] on the GPU); the rest are padding, left out of the K
    block and V scales and never attended. :func:`attention_fp8` then uses the same counts.

    qk_format: "e4m3" (default) or "int8": INT8 Q/K codes (torch.int8), q_descale per query row, k_descale
    per 16-key group (layouts in :class:`PreparedFP8`), every form above (batched, packed, key counts,
    head_dim 128 and 64). INT8 runs on the sm_90a fast path only: sizes past its range
    (ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32) raise ValueError naming qk_format. k_smoothing: quantize K
    minus its per-(sequence, head) channel mean over the valid keys (either format; attention is invariant
    to that shift, and the codes lose less to a common K offset). Anything but the two strings raises
    ValueError naming qk_format; a non-bool k_smoothing TypeError.
    """
    from . import ops   # imports torch and registers every custom op, on first use
    # The op checks the arguments (ValueError / TypeError naming them); here only what it cannot see.
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        rank, lens = 3, (max_seqlen_q, max_seqlen_k)
    else:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            name = "max_seqlen_q" if max_seqlen_q is not None else "max_seqlen_k"
            raise ValueError(f"{name}: only used with cu_seqlens_q and cu_seqlens_k (packed sequences), which are "
                             "None")
        q, k, v, rank = _checks.token_views(q, k, v)   # rank 3: one sequence, a batch of one for the op
        lens = (0, 0)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, *lens, seqused_k, qk_format, k_smoothing)
    tensors = ops.direct.run(ops.prepare_fp8_op, ops.fp8.prepare_cuda, (*args[:5], seqused_k), *args)
    if packed:
        sizes = dict(batch=int(cu_seqlens_q.shape[0]) - 1, seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k))
    else:
        sizes = dict(batch=int(q.shape[0]), seqlen_q=int(q.shape[1]), seqlen_k=int(k.shape[1]))
    return PreparedFP8(*tensors, **sizes, heads=int(q.shape[-2]), head_dim=int(q.shape[-1]), input_rank=rank,
                       dtype=q.dtype, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                       qk_format=qk_format, k_smoothing=k_smoothing)


def attention_fp8(prepared, *, softmax_scale=None, causal=False, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS,
                  return_lse=False, out_dtype=None, p_format="expcast"):
    """ExpCast FP8 attention on a preparation (docs/numerics.md sections 2-5), batched or packed.

    softmax_scale None means 1/sqrt(D). causal: key j visible to query i iff j <= i + (Sk - Sq) (with key
    counts, Sk is the entry's count). mid_window_blocks: the key traversal of section 5 (None: natural
    order). Returns out, bfloat16 in q's shape ([B, Sq, H, D] or [Sq, H, D]; packed: [total_q, H, D]);
    with return_lse, (out, lse) where lse is float32 natural-log [B, H, Sq] ([H, Sq] for a rank-3 q,
    [H, total_q] packed). head_dim 128 and 64 run the sm_90a fast path. A preparation with k_smoothing
    returns no LSE (ValueError naming prepared.k_smoothing: it holds no q . mean(K) to add back; attention()
    returns it).
    out_dtype: None or torch.bfloat16 (the default: BF16 out), or torch.float16: the kernels write FP16
    directly (no cast kernel), for FP16 models.
    The Q/K format is the preparation's (``prepared.qk_format``): an INT8 preparation runs on the fast path
    in every form above; one the fast path cannot take raises ValueError naming prepared.qk_format.
    p_format: P's code, an option of this call (not of the preparation: one preparation may be attended with
    either): "expcast" (default, ExpCast's linear code) or "exp2" (the E4M3 rounding of the exponential, within one
    step for keys 64-127 of each block, more accurate; docs/numerics.md "P format"), which needs an INT8
    preparation: with prepared.qk_format "e4m3" it raises ValueError naming p_format; anything but the two
    strings raises ValueError naming p_format.
    A GQA / MQA preparation (``prepared.kv_heads`` < ``prepared.heads``) runs on the fast path in every form above
    (Fp8Inputs::kv_heads); one past its range raises ValueError naming prepared.k_codes.
    """
    scale, mid = _checks.softmax_scale(softmax_scale), _checks.mid_window(mid_window_blocks)
    want_lse, causal = _checks.return_lse(return_lse), _checks.bool_arg(causal, "causal")
    _checks.require_instance(prepared, PreparedFP8, "prepared", "a PreparedFP8 from open_vc_attn.prepare_fp8")
    # The preparation's own rules, named by its fields; the op checks its arguments (the tensors) itself.
    fmt = _checks.qk_format(prepared.qk_format, "prepared.qk_format")
    _checks.p_format(p_format, fmt, "prepared.qk_format")
    _checks.lse_with_smoothing(want_lse, _checks.k_smoothing(prepared.k_smoothing, "prepared.k_smoothing"),
                               "prepared.k_smoothing")
    meta = _checks.check_prepared_fp8(prepared, allow_varlen=True, gqa=True)
    reason = _checks.general_path_reason(meta["head_dim"], meta["seqlen_q"], meta["seqlen_k"])
    _checks.require_fast_path(fmt, reason, "prepared.qk_format")
    _gqa.require_fast_path(meta["heads"], meta["kv_heads"], reason, "prepared.k_codes")
    from . import ops
    tensors, varlen = prepared.tensors(), prepared.is_varlen
    cu_q, cu_k, used = prepared.cu_seqlens_q, prepared.cu_seqlens_k, prepared.seqused_k
    max_q, max_k = (meta["seqlen_q"], meta["seqlen_k"]) if varlen else (0, 0)
    out, lse = ops.direct.run(ops.attention_fp8_op, ops.fp8.attention_cuda, (*tensors, cu_q, cu_k, used), *tensors,
                              cu_q, cu_k, max_q, max_k, scale, causal, mid, want_lse, used, out_dtype, fmt, p_format)
    # path "auto": the op took the general path exactly when there is a reason
    warn_after_call(reason, meta["seqlen_k"])
    return _finish(out, lse, 4 if varlen else meta["input_rank"], want_lse)


def attention(q, k, v, *, softmax_scale=None, causal=False, return_lse=False,
              mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, key_padding_mask=None, seqused_k=None, check_inputs=False, out_dtype=None,
              version="open-vc", mode="expcast", qk_format="e4m3", k_smoothing=False, p_format="expcast",
              block_mask=None, causal_chunk=1, v_bias_correction=False):
    """Attention of q, k, v: :func:`prepare_fp8` then ExpCast FP8 attention in one call (the FP8
    intermediates are freed on return), or a BF16 SDPA baseline (``version="reference", mode="bf16"``).

    Batched: q [B, Sq, H, D] or [Sq, H, D]; k, v [B, Sk, Hk, D] (or [Sk, Hk, D] with a rank-3 q).
    Packed sequences: q [total_q, H, D], k and v [total_k, Hk, D] with cu_seqlens_q / cu_seqlens_k (int32
    CUDA tensors of N + 1 offsets; each sequence is quantized and attended separately). max_seqlen_q /
    max_seqlen_k: Python ints >= every sequence's length; when omitted they are read from the offsets,
    which costs one device-to-host synchronization (and so breaks CUDA graph capture and
    torch.compile(fullgraph=True)): pass them there. bfloat16 or float16, head_dim 128 or 64.
    Hk = H, or a divisor of H (GQA / MQA, every option below): query head h attends K/V head h // (H // Hk), the
    result bit for bit that of k and v with each head repeated H // Hk times; an Hk that does not divide H, or a
    grouped call past the fast path's range (the general path takes equal head counts only), raises ValueError
    naming k before anything runs. The BF16 reference repeats the heads.

    softmax_scale None means 1/sqrt(D). causal: key j of a sequence is visible to its query i iff
    j <= i + (Sk - Sq) (aligned to the end); a row that sees no key gives output 0 and lse -inf.
    mid_window_blocks: key traversal (numerics.md section 5; None: natural order). Returns out, bfloat16
    in q's shape, or (out, lse) with return_lse: float32 natural-log LSE [B, H, Sq] ([H, Sq] for rank 3,
    [H, total_q] for packed sequences). Packed: output rows that no sequence covers are 0 (lse -inf).

    Key padding (batched, non-causal or causal): seqused_k, an int32 CUDA tensor [B] of key counts (entry
    b attends its first seqused_k[b] keys; clamped to [0, Sk]), or key_padding_mask, a key mask of shape
    [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk]: bool (True keeps the key) or additive float (0 keeps, <= -1000 or
    -inf masks; other values are biases, not applied). The mask's kept keys are moved to the front of
    each entry (a stable sort and one gather of k and v, no synchronization) and attended as key counts,
    exact for non-causal attention; with causal=True only seqused_k is taken. A row with no key gives 0.
    Packed sequences take seqused_k per sequence.

    check_inputs=True reads offsets, key counts and mask values back to the host (one synchronization)
    and raises ValueError for offsets that are negative, decreasing or past the tensors, a max_seqlen
    below the longest sequence, counts out of range, or additive masks holding biases. Without it nothing
    is read: the kernels clamp offsets and counts to the tensors (no out-of-bounds access whatever they
    hold) and the results are those of the clamped sequences (docs/api.md).

    out_dtype: None or torch.bfloat16 (default, BF16 out for BF16 and FP16 inputs alike), or torch.float16:
    the kernels write FP16 directly, so FP16 models need no cast kernel.

    qk_format: "e4m3" (default) or "int8" (INT8 Q/K codes with per-row Q and per-16-key-group K descales,
    docs/numerics.md section 9), in every call form above; INT8 runs on the sm_90a fast path only, so a
    call that would need the general path (sizes past its range) raises ValueError naming qk_format before
    anything is prepared. k_smoothing: quantize K minus its per-channel mean (either format; with
    return_lse, the LSE is that of the keys as given: the removed mean's term is added back, numerics
    section 9). See :func:`prepare_fp8`. p_format: P's code (docs/numerics.md "P format"): "expcast" (default,
    ExpCast's linear code of section 3) or "exp2" (the E4M3 rounding of the exponential, within one step for
    keys 64-127 of each block: lower error, on the H200 3.79% instead of 4.11% rel L2 on N(0,1) inputs at
    S = 4096 with INT8 + K smoothing), in every call form above;
    "exp2" needs qk_format="int8" (else ValueError naming p_format), anything but the two strings raises
    ValueError naming p_format. The BF16 reference (version="reference") checks and ignores all three.

    block_mask: block-sparse attention (docs/block_sparse.md): a torch FlexAttention BlockMask with BLOCK_SIZE 128
    built for (Sq, Sk) (open_vc_attn.masks makes video masks), or a (kv_num_blocks, kv_indices) pair of contiguous
    int32 CUDA tensors in its layout ([B or 1, H or 1, ceil(Sq/128)] and [.., K_tiles]). Query tile t (rows
    128 t ..) attends only the 128-key blocks listed for it, each whole (a BlockMask's partial and full blocks
    alike: its mask_mod is not evaluated, so element-level edges inside a block are not applied); indices ascend
    within a row; a tile with none gives output 0 and lse -inf. Batched calls, either Q/K format and head dim (the
    general path, where the fast path cannot take the call, visits the same blocks): not with cu_seqlens, causal,
    seqused_k / key_padding_mask, p_format "exp2" or the BF16 reference (ValueError naming block_mask).
    check_inputs=True also validates the lists' values on the host.

    causal_chunk: with causal=True, key j is visible to query i iff j < (floor((i + Sk - Sq) / F) + 1) * F for
    F = causal_chunk: every key of the query's own chunk of F keys and of the chunks before it (frame-causal
    video, element-exact: F = tokens per frame; numerics.md section 5). 1 (default) is plain causal. Every call
    form that takes causal takes it; the BF16 reference takes 1 only.

    v_bias_correction: add V's mean rounding error back to every output row that sees a key, per channel
    (docs/numerics.md section 4, "V rounding bias": the preparation sums each channel's E4M3 rounding residuals over
    the sequence's keys, the kernel adds their mean times V's descale). Exact where attention spreads evenly over
    the keys, it removes the part of V's rounding error that diffuse attention averages into a bias (on N(0,1)
    inputs, S = 4096, the CPU emulation of INT8 + K smoothing gives 3.81% rel L2 instead of 4.15%; sharp attention
    is unchanged). qk_format="int8" (ExpCast or exp2 P) in every fast-path call form but key block lists; E4M3 Q/K or
    a block_mask raise ValueError naming v_bias_correction (a call the general path would take is refused first,
    naming qk_format: INT8 runs on the fast path only). The BF16 reference checks and ignores it.
    """
    version = _checks.version(version, mode)
    scale, mid = _checks.softmax_scale(softmax_scale), _checks.mid_window(mid_window_blocks)
    v_bias = _checks.v_bias_correction(v_bias_correction)
    want_lse, causal = _checks.return_lse(return_lse), _checks.bool_arg(causal, "causal")
    reference = version == "reference"
    if reference:   # no op runs: the options of the FP8 path are checked here (and ignored)
        _checks.out_dtype(out_dtype)
        fmt = _checks.qk_format(qk_format)
        _checks.k_smoothing(k_smoothing)
        _checks.p_format(p_format, fmt)
        _checks.v_bias_correction(v_bias_correction, fmt)
    opts = (scale, causal, mid, want_lse, out_dtype, qk_format, k_smoothing, p_format)
    if reference and _checks.causal_chunk(causal_chunk, causal) != 1:
        raise ValueError("causal_chunk: the BF16 reference (version='reference') takes plain causal only (1)")
    if block_mask is not None:   # what the op cannot see: the BF16 reference, a mask that moves keys, packing
        from . import _block_sparse
        _block_sparse.reject_with(**{"version='reference'": reference, "key_padding_mask": key_padding_mask is not None,
                                     "cu_seqlens (packed sequences)":
                                         cu_seqlens_q is not None or cu_seqlens_k is not None})
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            name = "max_seqlen_q" if max_seqlen_q is not None else "max_seqlen_k"
            raise ValueError(f"{name}: only used with cu_seqlens_q and cu_seqlens_k (packed sequences), which are "
                             "None")
        # The op checks the tensors, except where they are used before it (the key mask's gather, the host
        # reads of check_inputs) or instead of it (the BF16 reference): there the same rules run here first.
        early = reference or key_padding_mask is not None or check_inputs
        q4, k4, v4, rank = (_checks.check_tokens(q, k, v, caller="attention", gqa=True) if early
                            else _checks.token_views(q, k, v))
        b, sk = int(q4.shape[0]), int(k4.shape[1])
        reason = _checks.general_path_reason(int(q4.shape[-1]), int(q4.shape[1]), sk)
        if not reference:   # before the key mask's gather: a grouped call runs on the fast path only
            _gqa.require_fast_path(int(q4.shape[2]), int(k4.shape[2]), reason)
        if key_padding_mask is not None:
            if seqused_k is not None:
                raise ValueError("key_padding_mask, seqused_k: pass one of them, not both")
            if causal:
                raise ValueError("key_padding_mask: not taken with causal=True (moving the kept keys to the front "
                                 "would change which keys a query sees); pass seqused_k for end padding")
        from . import _keys
        keep = _keys.key_mask(key_padding_mask, b, sk, q4.device) if key_padding_mask is not None else None
        if early:
            _checks.check_seqused_k(seqused_k, b, q4.device, "batch entries")
        if check_inputs:
            _keys.validate_on_host(seqused_k=seqused_k, slot_k=sk, key_padding_mask=key_padding_mask)
        if reference:
            from . import _sdpa
            return _cast_out(_sdpa.attention_bf16(q4, k4, v4, scale, causal, want_lse, rank, counts=seqused_k,
                                                  keep=keep), out_dtype)
        if keep is not None:
            k4, v4, seqused_k = _keys.compact_keys(k4, v4, keep)
        blocks = (None, None)
        if block_mask is not None:
            blocks = _block_sparse.lists_of(block_mask, seqlen_q=int(q4.shape[1]), seqlen_k=sk,
                                            check_inputs=check_inputs,
                                            batch=b, heads=int(q4.shape[2]))
        from . import ops
        out, lse = ops.call.attention(q4, k4, v4, None, None, 0, 0, seqused_k, *opts, *blocks, causal_chunk,
                                      v_bias)
        warn_after_call(reason, sk)
        return _finish(out, lse, rank, want_lse)
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask: not taken with cu_seqlens (packed sequences have no padding; pass "
                         "seqused_k to cut each sequence's keys)")
    max_q, max_k = _max_seqlen(max_seqlen_q, cu_seqlens_q), _max_seqlen(max_seqlen_k, cu_seqlens_k)
    if reference or check_inputs:   # as above: the op's rules first, where the tensors are read without it
        nseq = _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)
        _checks.check_seqused_k(seqused_k, nseq, q.device, "sequences")
    if check_inputs:
        from . import _keys
        _keys.validate_on_host(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, total_q=int(q.shape[0]),
                               total_k=int(k.shape[0]), max_seqlen_q=max_q, max_seqlen_k=max_k, seqused_k=seqused_k)
    if reference:
        if seqused_k is not None:
            raise ValueError("seqused_k: the BF16 reference (version='reference') of packed sequences does not take "
                             "key counts")
        from . import _sdpa
        return _cast_out(_sdpa.attention_bf16_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, want_lse),
                         out_dtype)
    from . import ops
    out, lse = ops.call.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_k, *opts, None, None,
                                  causal_chunk, v_bias)
    warn_after_call(_checks.general_path_reason(int(q.shape[-1]), max_q, max_k), max_k)
    return (out, lse) if want_lse else out
