"""Custom ops of the FP8 ExpCast path, one per step-wise public call (open_vc_attn.prepare_fp8, attention_fp8).

- ``open_vc_attn::prepare_fp8(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k,
  int max_seqlen_q, int max_seqlen_k, Tensor? seqused_k, str qk_format="e4m3", bool k_smoothing=False)
  -> (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)``: BF16/FP16 CUDA inputs, new contiguous
  outputs (see api.PreparedFP8). Offsets None: batched rank-4 [B, S, H, D] inputs (max_seqlen_q/k unused,
  pass 0). With int32 offsets (read on the GPU only): packed sequences, q [total_q, H, D], k and v
  [total_k, H, D], max_seqlen_q/k >= every sequence's length. seqused_k: optional int32 key counts, one per
  batch entry or sequence (keys past them are left out of the scales). qk_format "int8": INT8 Q/K codes
  (torch.int8) with q_descale [B, H, Sq] and k_descale [B, H, ceil(Sk/128), 8] (packed: [N, H, max_q] and
  [N, H, ceil(max_k/128), 8]), where the fast path can attend them only (else ValueError naming qk_format);
  k_smoothing: K minus its per-channel mean is quantized. k and v may hold Hk heads, a divisor of q's H
  (GQA/MQA, PrepareParams::kv_heads): the K/V outputs then hold Hk heads where the layouts say H.
- ``open_vc_attn::attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale,
  Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale,
  bool causal, int mid_window_blocks, bool return_lse, Tensor? seqused_k=None, ScalarType? out_dtype=None,
  str qk_format="e4m3", str p_format="expcast", str path="auto") -> (out, lse)``: the six tensors of a
  batched preparation (offsets None, max_seqlen_q/k unused: pass 0) give out [B, Sq, H, D] and lse float32
  [B, H, Sq]; with offsets, the packed layout of api.PreparedFP8 for max_seqlen_q/k gives out [total_q, H, D]
  (zeros where no sequence writes) and lse [H, total_q] (-inf there; the flash-attn varlen layout). out is
  BF16, or out_dtype; lse is an empty [0] tensor when return_lse is False (an op returns a fixed number of
  tensors). softmax_scale <= 0 means 1/sqrt(D); mid_window_blocks -1 means natural order; seqused_k:
  optional int32 key counts per batch entry or sequence. The op reads the Q/K format from qk_format, which
  must be the preparation's. p_format: "expcast" (ExpCast's linear P code) or "exp2" (P = the E4M3
  rounding of the exponential; qk_format "int8" only, else ValueError naming p_format); it changes no shape. v_descale
  [B, H] (packed [N, H]) holds one V descale per head, as prepare_fp8 writes it; [B, H, ceil(Sk/128)] (packed
  [N, H, ceil(max_seqlen_k/128)]) one per 128-key block (AttentionParams.v_descale_per_block: K/V chunks
  quantized separately, e.g. open_vc_attn.kv_cache; [B, Hk, ...] with GQA/MQA): fast path, head_dim 128, not
  causal, ExpCast P (ValueError naming v_descale otherwise). The K/V tensors may hold Hk heads, a divisor of H (GQA/MQA: the
  head count of k_codes is Fp8Inputs::kv_heads), on the fast path only (ValueError naming k_codes where the call
  would need the general path).

The route is :func:`route`'s, once per call: the sm_90a fast path where it takes the call (head_dim 128 or
64 within its 32-bit range; its dense kernel for batched, non-causal calls without key counts, else its
causal / packed / key-count modes; E4M3 or INT8), else the general path on the CUDA cores (E4M3 and
ExpCast only: INT8 there raises ValueError naming qk_format). path "general" forces the general path (tests
compare the two; qk_format "int8" or p_format "exp2" raise ValueError naming them), "fast" requires the fast
path (ValueError naming why it cannot take the call).
"""
import torch

from .. import _checks, _ext, _gqa
from .._layout import FP8_NAMES, fp8_expectations, varlen_expectations
from . import device as dev

_PREPARE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
                   "int max_seqlen_k, Tensor? seqused_k, str qk_format=\"e4m3\", bool k_smoothing=False) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_descale, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
                     "int max_seqlen_k, float softmax_scale, bool causal, int mid_window_blocks, bool return_lse, "
                     "Tensor? seqused_k=None, ScalarType? out_dtype=None, str qk_format=\"e4m3\", "
                     "str p_format=\"expcast\", str path=\"auto\") -> (Tensor, Tensor)")


def _allocate(expectations, alloc):
    return tuple(alloc(shape, getattr(torch, dtype)) for _, shape, dtype in expectations)


def launch_prepare(q, k, v, outs, packed_fields, seqused_k=None, workspace=None, qk_format="e4m3",
                   k_smoothing=False, out_layout=None, kv_prefix=None):
    """Enqueues openvc::prepare_fp8; packed_fields: the packed-sequence fields, or None (batched);
    seqused_k: optional int32 key counts (keys past them are padding); outs: the six outputs (tensors, or
    anything with data_ptr()); workspace: (pointer, bytes) of prepare_workspace_bytes scratch, or None to
    allocate it; qk_format, k_smoothing: checked values (PrepareParams.qk_format / .k_smoothing);
    out_layout: optional PrepareParams KV-cache layout fields (k_codes_rows, k_descale_blocks, v_packed_columns,
    v_descale_per_block: K and V written into a KV cache's slots, batched and without k_smoothing; the caller
    sizes outs);
    kv_prefix: optional (k0, v0) [B, r, Hk, D], keys before k and v (PrepareParams.kv_prefix_len: batched,
    no k_smoothing), prepared with them as one sequence of r + Sk keys. k and v of fewer heads than q
    (GQA/MQA, checked by the caller): PrepareParams.kv_heads (outs, out_layout and kv_prefix of k's heads)."""
    ext = _ext.load()
    p = dev.params(ext.PrepareParams, dtype=dev.dtype_of(q), heads=int(q.shape[-2]), head_dim=int(q.shape[-1]),
                   q=dev.token_view(q, packed_fields is not None), k=dev.token_view(k, packed_fields is not None),
                   v=dev.token_view(v, packed_fields is not None), qk_format=dev.qk_format(qk_format),
                   k_smoothing=bool(k_smoothing), **dict(zip(FP8_NAMES, (t.data_ptr() for t in outs))))
    if int(k.shape[-2]) != p.heads:   # GQA/MQA: the struct's 0 means equal head counts
        p.kv_heads = int(k.shape[-2])
    if packed_fields is None:
        p.batch, p.seqlen_q, p.seqlen_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        groups, max_k = p.batch, p.seqlen_k
    else:
        for name, value in packed_fields.items():
            setattr(p, name, value)
        groups, max_k = p.num_seqs, p.max_seqlen_k
    if seqused_k is not None:
        p.seqused_k = seqused_k.data_ptr()
    for name, value in (out_layout or {}).items():
        setattr(p, name, value)
    if kv_prefix is not None and kv_prefix[0].shape[1] > 0:
        p.kv_prefix_len = int(kv_prefix[0].shape[1])
        p.k_prefix, p.v_prefix = dev.token_view(kv_prefix[0]), dev.token_view(kv_prefix[1])
        p.seqlen_k += p.kv_prefix_len
    if workspace is None:   # v_amax scratch (and the K channel sums with k_smoothing)
        max_k = p.seqlen_k if packed_fields is None else max_k   # with a prefix: its keys counted
        ws = dev.workspace(ext.prepare_workspace_bytes(groups, p.heads, max_k, bool(k_smoothing)), q.device)
        workspace = ws.data_ptr(), ws.numel()
    p.workspace, p.workspace_bytes = workspace
    dev.enqueue(ext.prepare_fp8, p, q.device)


# ---- prepare_fp8 ----------------------------------------------------------------------------------------

def _prepare_outputs(q, k, alloc, qk_format="e4m3", packed=None):
    """The six outputs: of a batched preparation (packed None), or packed = (N, max_seqlen_q, max_seqlen_k);
    the K/V side's with k's head count (GQA/MQA)."""
    hk = k.shape[-2]
    if packed is None:
        b, sq, h, d = q.shape
        return _allocate(fp8_expectations(b, sq, k.shape[1], h, d, qk_format, hk=hk), alloc)
    total_q, h, d = q.shape
    return _allocate(varlen_expectations(packed[0], total_q, k.shape[0], h, d, *packed[1:], qk_format, hk=hk), alloc)


def _prepare_args(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, qk_format, k_smoothing):
    """The op's argument rules (the CUDA and the fake implementation): (packed, qk_format, k_smoothing);
    packed: (N, max_seqlen_q, max_seqlen_k), or None for a batched call."""
    fmt, smooth = _checks.qk_format(qk_format), _checks.k_smoothing(k_smoothing)
    if cu_q is None and cu_k is None:
        _checks.check_rank4_tokens("prepare_fp8", q, k, v, gqa=True)
        packed, groups, sq, sk = None, q.shape[0], q.shape[1], k.shape[1]
    else:
        groups = _checks.check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        packed, sq, sk = (groups, max_q, max_k), max_q, max_k
    reason = _checks.general_path_reason(int(q.shape[-1]), sq, sk)
    _checks.require_fast_path(fmt, reason)
    _gqa.require_fast_path(int(q.shape[-2]), int(k.shape[-2]), reason)   # (what attention_fp8 could not attend)
    _checks.check_seqused_k(seqused_k, int(groups), q.device, "batch entries" if packed is None else "sequences")
    return packed, fmt, smooth


def prepare_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, qk_format="e4m3",
                 k_smoothing=False):
    """The CUDA implementation of prepare_fp8: the argument checks, then the device and alignment checks."""
    packed, qk_format, k_smoothing = _prepare_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   seqused_k, qk_format, k_smoothing)
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    outs = _prepare_outputs(q, k, dev.empty(q.device), qk_format, packed)
    fields = None if packed is None else dict(
        num_seqs=packed[0], max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(), total_q=int(q.shape[0]),
        total_k=int(k.shape[0]))
    launch_prepare(q, k, v, outs, fields, seqused_k, qk_format=qk_format, k_smoothing=k_smoothing)
    return outs


def prepare_into_slots(q, k, v, qk_format, kv_outs, out_layout, kv_prefix=None):
    """prepare_fp8's checks and kernels for a batched call whose K and V outputs lie in a KV cache's buffers
    (open_vc_attn.kv_cache): kv_outs the views (k_codes, k_descale, v_packed, v_descale) at the cache's first
    free slot, out_layout PrepareParams' output layout fields (the cache sizes its buffers for the call),
    kv_prefix an optional (k0, v0) of keys before k and v (the cache's remainder, checked by the cache).
    Returns the new (q_codes, q_descale). Not an op: the cache mutates its own buffers, eagerly. k and v (and the
    views, and the prefix) may hold Hk heads, a divisor of q's (GQA/MQA; _prepare_args names k otherwise)."""
    _, fmt, _ = _prepare_args(q, k, v, None, None, 0, 0, None, qk_format, False)
    named = (("q", q), ("k", k), ("v", v))
    if kv_prefix is not None:
        named += (("k (the cache's remainder)", kv_prefix[0]), ("v (the cache's remainder)", kv_prefix[1]))
    dev.launch_checks(q.device, named)
    b, sq, h, d = q.shape
    q_outs = _allocate(fp8_expectations(b, sq, k.shape[1], h, d, fmt)[:2], dev.empty(q.device))
    launch_prepare(q, k, v, (*q_outs, *kv_outs), None, qk_format=fmt, out_layout=out_layout, kv_prefix=kv_prefix)
    return q_outs


_prepare_op = torch.library.custom_op("open_vc_attn::prepare_fp8", mutates_args=(), device_types="cuda",
                                      schema=_PREPARE_SCHEMA)(prepare_cuda)


@_prepare_op.register_fake
def _prepare_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, qk_format="e4m3",
                  k_smoothing=False):
    packed, fmt, _ = _prepare_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                   qk_format, k_smoothing)
    return _prepare_outputs(q, k, dev.like(q), fmt, packed)


# ---- attention_fp8: one op, three routes ------------------------------------------------------------------

def attention_outputs(q_codes, return_lse, alloc, out_dtype=None):
    """out [B, Sq, H, D] (BF16, or out_dtype) and lse float32 [B, H, Sq] (or [0]) of the dense fast path
    (attention_fp8's dense route, attention_fp8_repair, attention_vc_fp8)."""
    b, sq, h, d = q_codes.shape
    return (alloc((b, sq, h, d), _checks.out_dtype(out_dtype)),
            alloc((b, h, sq) if return_lse else (0,), torch.float32))


def fast_params(tensors, sizes, out, lse, softmax_scale, mid_window_blocks, qk_format=None, p_format=None,
                kv_heads=None):
    """openvc::AttentionParams of the fast path (repair rows unset; qk_format None: the struct's E4M3;
    p_format None: the struct's ExpCast; kv_heads: Fp8Inputs::kv_heads of a GQA/MQA preparation)."""
    p = dev.params(_ext.load().AttentionParams, in_=dev.fp8_inputs(tensors, *sizes, fmt=qk_format, kv_heads=kv_heads),
                   mid_window_blocks=int(mid_window_blocks))
    if p_format is not None:
        dev.set_p_format(p, p_format)
    return dev.set_output(p, out, lse, softmax_scale)


def sequence_outputs(packed, sizes, return_lse, alloc, fill, out_dtype=None):
    """out and lse of attention_fp8 (and of open_vc_attn::attention). Packed: out [total_q, H, D] zeros and
    lse [H, total_q] -inf, so the rows that no (clamped) sequence covers are defined; batched: [B, Sq, H, D]
    and [B, H, Sq], all written. out is BF16, or out_dtype."""
    n, sq, _, h, d = sizes
    dtype = _checks.out_dtype(out_dtype)
    if packed:
        return (fill((sq, h, d), dtype, 0.0), fill((h, sq) if return_lse else (0,), torch.float32, float("-inf")))
    return alloc((n, sq, h, d), dtype), alloc((n, h, sq) if return_lse else (0,), torch.float32)


def route(path, qk_format, packed, sizes, max_q, max_k, causal, seqused_k, kv_heads=None):
    """Where a checked call runs: "dense" (the fast path's dense kernel), "fast" (its causal / packed /
    key-count modes) or "general" (the CUDA cores), by _checks.general_path_reason (what api.py warns about
    too). Raises ValueError for what no route takes: path "fast" past the fast path, INT8 or GQA/MQA (kv_heads:
    k_codes' head count) past it, more batches / sequences or heads than the general path's grid."""
    reason = _checks.general_path_reason(int(sizes[4]), max_q if packed else sizes[1], max_k if packed else sizes[2])
    if path == "general" or reason is not None:
        if path == "fast":
            raise ValueError(f"path: 'fast' requires the sm_90a fast path, which cannot take this call: {reason}; "
                             "use path='auto' or 'general'")
        _checks.require_fast_path(qk_format, reason)
        _gqa.require_fast_path(int(sizes[3]), int(sizes[3] if kv_heads is None else kv_heads),
                               reason or "path='general' asks for it", "k_codes")
        _checks.check_general_grid(sizes[0], sizes[3], ("cu_seqlens_q" if packed else "q_codes", "q_codes"), packed)
        return "general"
    return "fast" if packed or causal or seqused_k is not None else "dense"


def v_descale_per_block(tensors):
    """Whether v_descale holds one descale per 128-key block (rank 3) instead of one per head (rank 2)."""
    return isinstance(tensors[5], torch.Tensor) and tensors[5].dim() == 3


def _attention_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, mid_window_blocks, seqused_k, qk_format,
                    p_format, path):
    """The op's argument rules (the CUDA and the fake implementation): (packed, sizes, route, v_blocks), v_blocks:
    v_descale holds one descale per key block. The K/V head count is k_codes' (GQA/MQA where it is below H)."""
    v_blocks = v_descale_per_block(tensors)
    packed, sizes = _checks.check_attention_op_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale,
                                                    mid_window_blocks, qk_format, p_format, path, v_blocks)
    kv_heads = int(tensors[2].shape[-2])
    where = route(path, qk_format, packed, sizes, max_q, max_k, causal, seqused_k, kv_heads)
    if v_blocks and (where == "general" or causal or sizes[4] != 128 or p_format == "exp2"):
        why = ("the sm_90a fast path cannot take this call (path='general', or past its range)" if where == "general"
               else "causal" if causal else f"head_dim {sizes[4]}" if sizes[4] != 128 else "p_format 'exp2'")
        raise ValueError(f"v_descale: descales per key block (rank 3) run on the fast path with head_dim 128, "
                         f"ExpCast P and no causal mask; not with {why}")
    _checks.check_seqused_k(seqused_k, int(sizes[0]), tensors[0].device, "sequences" if packed else "batch entries")
    return packed, sizes, where, v_blocks


def attention_cuda(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse, seqused_k=None,
                   out_dtype=None, qk_format="e4m3", p_format="expcast", path="auto"):
    """The CUDA implementation of attention_fp8: the argument checks and the route, then the device and
    alignment checks, then the route's kernel."""
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    packed, sizes, where, v_blocks = _attention_args(tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     softmax_scale, causal, mid_window_blocks, seqused_k, qk_format,
                                                     p_format, path)
    dev.launch_checks(q_codes.device, zip(FP8_NAMES, tensors))
    kv_heads = int(k_codes.shape[-2])
    if where == "dense":
        return enqueue_fast(tensors, tuple(int(s) for s in sizes), q_codes.device, softmax_scale, mid_window_blocks,
                            return_lse, out_dtype, qk_format, p_format, v_blocks, kv_heads)
    return enqueue_sequence(where == "fast", tensors, packed, sizes, q_codes.device, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse, seqused_k,
                            out_dtype, qk_format, p_format, v_blocks, kv_heads)


def enqueue_fast(tensors, sizes, device, softmax_scale, mid_window_blocks, return_lse, out_dtype=None,
                 qk_format="e4m3", p_format="expcast", v_blocks=False, kv_heads=None):
    """The dense fast path on a checked batched preparation (tensors, or anything with data_ptr() and a
    q_codes shape): allocates (out, lse) and enqueues the kernel (AttentionParams.p_format from p_format;
    v_blocks: AttentionParams.v_descale_per_block; kv_heads: the K/V head count, GQA/MQA)."""
    out, lse = attention_outputs(tensors[0], return_lse, dev.empty(device), out_dtype)
    p = fast_params(tensors, sizes, out, lse if return_lse else None, softmax_scale, mid_window_blocks, qk_format,
                    p_format, kv_heads)
    if v_blocks:
        p.v_descale_per_block = True
    dev.enqueue(_ext.load().attention_fp8, p, device)
    return out, lse


def enqueue_sequence(fast, tensors, packed, sizes, device, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                     mid_window_blocks, return_lse, seqused_k, out_dtype=None, qk_format="e4m3", p_format="expcast",
                     v_blocks=False, kv_heads=None):
    """The fast path's causal / packed / key-count modes (fast) or the general path on checked arguments
    (tensors: as in :func:`enqueue_fast`): allocates (out, lse) and enqueues the kernel (fast:
    AttentionParams.p_format from p_format; the general path's struct has no P format: it computes ExpCast,
    and route() never sends it exp2 nor a GQA/MQA call; kv_heads: the K/V head count)."""
    n, sq, sk, h, d = (int(x) for x in sizes)
    out, lse = sequence_outputs(packed, sizes, return_lse, dev.empty(device), dev.full(device), out_dtype)
    ext = _ext.load()
    p = dev.params(ext.AttentionParams if fast else ext.GeneralAttentionParams, causal=bool(causal),
                   mid_window_blocks=int(mid_window_blocks))
    if packed:   # C++: batch sizes ignored; out [total_q, H, D] and lse [H, total_q] strides
        p.in_ = dev.fp8_inputs(tensors, 0, 0, 0, h, d, fmt=qk_format, kv_heads=kv_heads)
        p.cu_seqlens_q, p.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
        p.num_seqs, p.max_seqlen_q, p.max_seqlen_k = n, int(max_q), int(max_k)
        p.total_q, p.total_k = sq, sk   # offsets are clamped to these on the device
        out_strides, lse_strides = (0, *out.stride()[:2]), (0, sq)
    else:
        p.in_ = dev.fp8_inputs(tensors, n, sq, sk, h, d, fmt=qk_format, kv_heads=kv_heads)
        out_strides, lse_strides = out.stride()[:3], (h * sq, sq)
    if fast:
        dev.set_p_format(p, p_format)
        if v_blocks:
            p.v_descale_per_block = True
    else:   # the fast path's LSE layouts are fixed (the same ones)
        p.lse_stride_batch, p.lse_stride_head = lse_strides
    if seqused_k is not None:
        p.seqused_k = seqused_k.data_ptr()
    dev.set_output(p, out, lse if return_lse else None, softmax_scale, out_strides)
    dev.enqueue(ext.attention_fp8 if fast else ext.attention_general, p, device)
    return out, lse


_attention_op = torch.library.custom_op("open_vc_attn::attention_fp8", mutates_args=(), device_types="cuda",
                                        schema=_ATTENTION_SCHEMA)(attention_cuda)


@_attention_op.register_fake
def _attention_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse, seqused_k=None,
                    out_dtype=None, qk_format="e4m3", p_format="expcast", path="auto"):
    packed, sizes, _, _ = _attention_args((q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), cu_seqlens_q,
                                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                       mid_window_blocks, seqused_k, qk_format, p_format, path)
    return sequence_outputs(packed, sizes, return_lse, dev.like(q_codes), dev.like_full(q_codes), out_dtype)
