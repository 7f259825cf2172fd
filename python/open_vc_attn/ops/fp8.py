"""Custom ops of the FP8 ExpCast path: preparation and the fast and general attention kernels.

- ``open_vc_attn::prepare_fp8(Tensor q, Tensor k, Tensor v, Tensor? seqused_k=None, str qk_format="e4m3",
  bool k_smoothing=False) -> (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)``: rank-4 BF16/FP16
  CUDA inputs, new contiguous outputs (see api.PreparedFP8); seqused_k: optional int32 [B] key counts (keys
  past them are left out of the scales). qk_format "int8": INT8 Q/K codes (torch.int8) with q_descale
  [B, H, Sq] and k_descale [B, H, ceil(Sk/128), 8]; k_smoothing: K minus its per-channel mean is quantized.
- ``open_vc_attn::prepare_fp8_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  int max_seqlen_q, int max_seqlen_k, Tensor? seqused_k=None, str qk_format="e4m3", bool k_smoothing=False)
  -> (six tensors)``: packed sequences, q [total_q, H, D], k and v [total_k, H, D], int32 offsets (read on
  the GPU only); outputs as described in api.PreparedFP8.
- ``open_vc_attn::attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale,
  float softmax_scale, int mid_window_blocks, bool return_lse, ScalarType? out_dtype=None,
  str qk_format="e4m3", str p_format="expcast") -> (out, lse)``: out BF16 [B, Sq, H, D];
  lse float32 [B, H, Sq], or an empty [0] tensor when return_lse is False (an op returns a fixed number
  of tensors). softmax_scale <= 0 means 1/sqrt(D); mid_window_blocks -1 means natural order. The sm_90a
  fast path: head_dim 128 or 64, non-causal, batched; E4M3 or INT8.
- ``open_vc_attn::attention_general(six tensors, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q,
  int max_seqlen_k, float softmax_scale, bool causal, int mid_window_blocks, bool return_lse,
  Tensor? seqused_k=None, ScalarType? out_dtype=None, str qk_format="e4m3", str p_format="expcast") -> (out, lse)``:
  the general path (CUDA cores; head_dim 64 or 128; E4M3 and ExpCast only: qk_format "int8" or p_format "exp2"
  raises ValueError naming it). Without
  offsets the six tensors are a batched preparation and the outputs are those of attention_fp8
  (max_seqlen_q/k ignored); with them, the packed layout of api.PreparedFP8 for max_seqlen_q/k, out BF16
  [total_q, H, D] (zeros where no sequence writes) and lse float32 [H, total_q] (-inf there; the flash-attn
  varlen layout). seqused_k: optional int32 key counts per batch entry or sequence.
- ``open_vc_attn::attention_fp8_full(the same arguments) -> (out, lse)``: the sm_90a fast path in its causal,
  packed-sequence and key-count modes (head_dim 128 or 64; E4M3 or INT8), same outputs.
The attention ops read the Q/K format from their qk_format argument, which must be the preparation's.
p_format (attention_fp8, attention_fp8_full): "expcast" (ExpCast's linear P code) or "exp2" (P = E4M3 RNE of
an exact exponential; qk_format "int8" only, else ValueError naming p_format); it changes no shape.
"""
import torch

from .. import _checks, _ext
from .._layout import FP8_NAMES, fp8_expectations, varlen_expectations
from . import device as dev

_PREPARE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? seqused_k=None, str qk_format=\"e4m3\", "
                   "bool k_smoothing=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_PREPARE_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                          "int max_seqlen_k, Tensor? seqused_k=None, str qk_format=\"e4m3\", bool k_smoothing=False) "
                          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_descale, float softmax_scale, int mid_window_blocks, bool return_lse, "
                     "ScalarType? out_dtype=None, str qk_format=\"e4m3\", str p_format=\"expcast\") "
                     "-> (Tensor, Tensor)")
# attention_general and attention_fp8_full (the same arguments: every call form, general or fast path).
_SEQUENCE_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                    "Tensor v_descale, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                    "float softmax_scale, bool causal, int mid_window_blocks, bool return_lse, "
                    "Tensor? seqused_k=None, ScalarType? out_dtype=None, str qk_format=\"e4m3\", "
                    "str p_format=\"expcast\") -> (Tensor, Tensor)")


def _allocate(expectations, alloc):
    return tuple(alloc(shape, getattr(torch, dtype)) for _, shape, dtype in expectations)


def launch_prepare(q, k, v, outs, packed_fields, seqused_k=None, workspace=None, qk_format="e4m3",
                   k_smoothing=False):
    """Enqueues openvc::prepare_fp8; packed_fields: the packed-sequence fields, or None (batched);
    seqused_k: optional int32 key counts (keys past them are padding); outs: the six outputs (tensors, or
    anything with data_ptr()); workspace: (pointer, bytes) of prepare_workspace_bytes scratch, or None to
    allocate it; qk_format, k_smoothing: checked values (PrepareParams.qk_format / .k_smoothing)."""
    ext = _ext.load()
    p = dev.params(ext.PrepareParams, dtype=dev.dtype_of(q), heads=int(q.shape[-2]), head_dim=int(q.shape[-1]),
                   q=dev.token_view(q, packed_fields is not None), k=dev.token_view(k, packed_fields is not None),
                   v=dev.token_view(v, packed_fields is not None), qk_format=dev.qk_format(qk_format),
                   k_smoothing=bool(k_smoothing), **dict(zip(FP8_NAMES, (t.data_ptr() for t in outs))))
    if packed_fields is None:
        p.batch, p.seqlen_q, p.seqlen_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        groups, max_k = p.batch, p.seqlen_k
    else:
        for name, value in packed_fields.items():
            setattr(p, name, value)
        groups, max_k = p.num_seqs, p.max_seqlen_k
    if seqused_k is not None:
        p.seqused_k = seqused_k.data_ptr()
    if workspace is None:   # v_amax scratch (and the K channel sums with k_smoothing)
        ws = dev.workspace(ext.prepare_workspace_bytes(groups, p.heads, max_k, bool(k_smoothing)), q.device)
        workspace = ws.data_ptr(), ws.numel()
    p.workspace, p.workspace_bytes = workspace
    dev.enqueue(ext.prepare_fp8, p, q.device)


# ---- prepare_fp8 ----------------------------------------------------------------------------------------

def _prepare_outputs(q, k, alloc, qk_format="e4m3"):
    b, sq, h, d = q.shape
    return _allocate(fp8_expectations(b, sq, k.shape[1], h, d, qk_format), alloc)


def _format_args(qk_format, k_smoothing):
    """The ops' qk_format and k_smoothing arguments, checked (ValueError / TypeError naming them)."""
    return _checks.qk_format(qk_format), _checks.k_smoothing(k_smoothing)


def _check_prepare(q, k, v, seqused_k, qk_format, k_smoothing):
    fmt, smooth = _format_args(qk_format, k_smoothing)
    _checks.check_rank4_tokens("prepare_fp8", q, k, v)
    _checks.check_seqused_k(seqused_k, int(q.shape[0]), q.device, "batch entries")
    return fmt, smooth


def prepare_cuda(q, k, v, seqused_k=None, qk_format="e4m3", k_smoothing=False):
    """The CUDA implementation of prepare_fp8: the argument checks, then the device and alignment checks."""
    qk_format, k_smoothing = _check_prepare(q, k, v, seqused_k, qk_format, k_smoothing)
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    outs = _prepare_outputs(q, k, dev.empty(q.device), qk_format)
    launch_prepare(q, k, v, outs, None, seqused_k, qk_format=qk_format, k_smoothing=k_smoothing)
    return outs


@torch.library.custom_op("open_vc_attn::prepare_fp8", mutates_args=(), device_types="cuda", schema=_PREPARE_SCHEMA)
def _prepare_fp8(q, k, v, seqused_k=None, qk_format="e4m3", k_smoothing=False):
    return prepare_cuda(q, k, v, seqused_k, qk_format=qk_format, k_smoothing=k_smoothing)


@_prepare_fp8.register_fake
def _prepare_fp8_fake(q, k, v, seqused_k=None, qk_format="e4m3", k_smoothing=False):
    fmt, _ = _check_prepare(q, k, v, seqused_k, qk_format, k_smoothing)
    return _prepare_outputs(q, k, dev.like(q), fmt)


# ---- prepare_fp8_varlen (packed sequences) ----------------------------------------------------------------

def _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k, alloc, qk_format="e4m3"):
    total_q, h, d = q.shape
    return _allocate(varlen_expectations(nseq, total_q, k.shape[0], h, d, max_seqlen_q, max_seqlen_k, qk_format),
                     alloc)


def _check_prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, qk_format,
                          k_smoothing):
    fmt, smooth = _format_args(qk_format, k_smoothing)
    nseq = _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _checks.check_seqused_k(seqused_k, nseq, q.device, "sequences")
    return nseq, fmt, smooth


def prepare_varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                        qk_format="e4m3", k_smoothing=False):
    """The CUDA implementation of prepare_fp8_varlen (as :func:`prepare_cuda`, with check_varlen)."""
    nseq, qk_format, k_smoothing = _check_prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                         max_seqlen_k, seqused_k, qk_format, k_smoothing)
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    outs = _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k, dev.empty(q.device), qk_format)
    launch_prepare(q, k, v, outs, dict(num_seqs=nseq, max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                                        cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(),
                                        total_q=int(q.shape[0]), total_k=int(k.shape[0])), seqused_k,
                   qk_format=qk_format, k_smoothing=k_smoothing)
    return outs


@torch.library.custom_op("open_vc_attn::prepare_fp8_varlen", mutates_args=(), device_types="cuda",
                         schema=_PREPARE_VARLEN_SCHEMA)
def _prepare_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                        qk_format="e4m3", k_smoothing=False):
    return prepare_varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                               qk_format=qk_format, k_smoothing=k_smoothing)


@_prepare_fp8_varlen.register_fake
def _prepare_fp8_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                             qk_format="e4m3", k_smoothing=False):
    nseq, fmt, _ = _check_prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                         qk_format, k_smoothing)
    return _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k, dev.like(q), fmt)


# ---- attention_fp8 (the sm_90a fast path) -----------------------------------------------------------------

def attention_outputs(q_codes, return_lse, alloc, out_dtype=None):
    """out [B, Sq, H, D] (BF16, or out_dtype) and lse float32 [B, H, Sq] (or [0]) of the batched attention ops."""
    b, sq, h, d = q_codes.shape
    return (alloc((b, sq, h, d), _checks.out_dtype(out_dtype)),
            alloc((b, h, sq) if return_lse else (0,), torch.float32))


def fast_params(tensors, sizes, out, lse, softmax_scale, mid_window_blocks, qk_format=None, p_format=None):
    """openvc::AttentionParams of the fast path (repair rows unset; qk_format None: the struct's E4M3;
    p_format None: the struct's ExpCast)."""
    p = dev.params(_ext.load().AttentionParams, in_=dev.fp8_inputs(tensors, *sizes, fmt=qk_format),
                   mid_window_blocks=int(mid_window_blocks))
    if p_format is not None:
        dev.set_p_format(p, p_format)
    return dev.set_output(p, out, lse, softmax_scale)


def attention_cuda(tensors, softmax_scale, mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3",
                   p_format="expcast"):
    """The CUDA implementation of attention_fp8: the argument checks, then the device and alignment checks."""
    q_codes = tensors[0]
    sizes = tuple(int(s) for s in _checks.check_fast_op_args(tensors, softmax_scale, mid_window_blocks,
                                                             fmt=qk_format, p_fmt=p_format))
    dev.launch_checks(q_codes.device, zip(FP8_NAMES, tensors))
    return enqueue_fast(tensors, sizes, q_codes.device, softmax_scale, mid_window_blocks, return_lse, out_dtype,
                        qk_format, p_format)


def enqueue_fast(tensors, sizes, device, softmax_scale, mid_window_blocks, return_lse, out_dtype=None,
                 qk_format="e4m3", p_format="expcast"):
    """The dense fast path on a checked batched preparation (tensors, or anything with data_ptr() and a
    q_codes shape): allocates (out, lse) and enqueues the kernel (AttentionParams.p_format from p_format)."""
    out, lse = attention_outputs(tensors[0], return_lse, dev.empty(device), out_dtype)
    p = fast_params(tensors, sizes, out, lse if return_lse else None, softmax_scale, mid_window_blocks, qk_format,
                    p_format)
    dev.enqueue(_ext.load().attention_fp8, p, device)
    return out, lse


@torch.library.custom_op("open_vc_attn::attention_fp8", mutates_args=(), device_types="cuda",
                         schema=_ATTENTION_SCHEMA)
def _attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, softmax_scale,
                   mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    return attention_cuda((q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), softmax_scale,
                          mid_window_blocks, return_lse, out_dtype, qk_format=qk_format, p_format=p_format)


@_attention_fp8.register_fake
def _attention_fp8_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, softmax_scale,
                        mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    _checks.check_fast_op_args(tensors, softmax_scale, mid_window_blocks, fmt=qk_format, p_fmt=p_format)
    return attention_outputs(q_codes, return_lse, dev.like(q_codes), out_dtype)


# ---- attention_general and attention_fp8_full: every call form --------------------------------------------
# attention_general: the CUDA-core general path (head_dim 64 or 128). attention_fp8_full: the sm_90a fast
# path in its causal / packed / key-count modes (head_dim 128 or 64). Same arguments, same outputs.

def sequence_outputs(packed, sizes, return_lse, alloc, fill, out_dtype=None):
    """out and lse of the sequence ops. Packed: out [total_q, H, D] zeros and lse [H, total_q] -inf, so the
    rows that no (clamped) sequence covers are defined; batched: [B, Sq, H, D] and [B, H, Sq], all written.
    out is BF16, or out_dtype."""
    n, sq, _, h, d = sizes
    dtype = _checks.out_dtype(out_dtype)
    if packed:
        return (fill((sq, h, d), dtype, 0.0), fill((h, sq) if return_lse else (0,), torch.float32, float("-inf")))
    return alloc((n, sq, h, d), dtype), alloc((n, h, sq) if return_lse else (0,), torch.float32)


def _sequence_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks, seqused_k, fast,
                   qk_format="e4m3", p_format="expcast"):
    packed, sizes = _checks.check_general_op_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale,
                                                  mid_window_blocks, fast=fast, fmt=qk_format, p_fmt=p_format)
    _checks.check_seqused_k(seqused_k, int(sizes[0]), tensors[0].device, "sequences" if packed else "batch entries")
    return packed, sizes


def sequence_cuda(fast, tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, mid_window_blocks, return_lse,
                  seqused_k, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    """The CUDA implementation of attention_fp8_full (fast) and attention_general (as :func:`attention_cuda`)."""
    qc = tensors[0]
    packed, sizes = _sequence_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks,
                                   seqused_k, fast, qk_format, p_format)
    dev.launch_checks(qc.device, zip(FP8_NAMES, tensors))
    return enqueue_sequence(fast, tensors, packed, sizes, qc.device, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                            mid_window_blocks, return_lse, seqused_k, out_dtype, qk_format, p_format)


def enqueue_sequence(fast, tensors, packed, sizes, device, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                     mid_window_blocks, return_lse, seqused_k, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    """attention_fp8_full (fast) or attention_general on checked arguments (tensors: as in
    :func:`enqueue_fast`): allocates (out, lse) and enqueues the kernel (fast: AttentionParams.p_format from
    p_format; the general path's struct has no P format: it computes ExpCast, and its callers reject exp2)."""
    n, sq, sk, h, d = (int(x) for x in sizes)
    out, lse = sequence_outputs(packed, sizes, return_lse, dev.empty(device), dev.full(device), out_dtype)
    ext = _ext.load()
    p = dev.params(ext.AttentionParams if fast else ext.GeneralAttentionParams, causal=bool(causal),
                   mid_window_blocks=int(mid_window_blocks))
    if packed:   # C++: batch sizes ignored; out [total_q, H, D] and lse [H, total_q] strides
        p.in_ = dev.fp8_inputs(tensors, 0, 0, 0, h, d, fmt=qk_format)
        p.cu_seqlens_q, p.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
        p.num_seqs, p.max_seqlen_q, p.max_seqlen_k = n, int(max_q), int(max_k)
        p.total_q, p.total_k = sq, sk   # offsets are clamped to these on the device
        out_strides, lse_strides = (0, *out.stride()[:2]), (0, sq)
    else:
        p.in_ = dev.fp8_inputs(tensors, n, sq, sk, h, d, fmt=qk_format)
        out_strides, lse_strides = out.stride()[:3], (h * sq, sq)
    if fast:
        dev.set_p_format(p, p_format)
    else:   # the fast path's LSE layouts are fixed (the same ones)
        p.lse_stride_batch, p.lse_stride_head = lse_strides
    if seqused_k is not None:
        p.seqused_k = seqused_k.data_ptr()
    dev.set_output(p, out, lse if return_lse else None, softmax_scale, out_strides)
    dev.enqueue(ext.attention_fp8 if fast else ext.attention_general, p, device)
    return out, lse


def _fake_sequence(fast, tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks, return_lse, seqused_k,
                   out_dtype=None, qk_format="e4m3", p_format="expcast"):
    packed, sizes = _sequence_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks, seqused_k, fast,
                                   qk_format, p_format)
    like = dev.like(tensors[0])
    return sequence_outputs(packed, sizes, return_lse, like, dev.like_full(tensors[0]), out_dtype)


@torch.library.custom_op("open_vc_attn::attention_general", mutates_args=(), device_types="cuda",
                         schema=_SEQUENCE_SCHEMA)
def _attention_general(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse, seqused_k=None,
                       out_dtype=None, qk_format="e4m3", p_format="expcast"):
    return sequence_cuda(False, (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks,
                         return_lse, seqused_k, out_dtype, qk_format=qk_format, p_format=p_format)


@_attention_general.register_fake
def _attention_general_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks,
                            return_lse, seqused_k=None, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    return _fake_sequence(False, (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, mid_window_blocks, return_lse,
                          seqused_k, out_dtype, qk_format, p_format)


@torch.library.custom_op("open_vc_attn::attention_fp8_full", mutates_args=(), device_types="cuda",
                         schema=_SEQUENCE_SCHEMA)
def _attention_fp8_full(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse,
                        seqused_k=None, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    return sequence_cuda(True, (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks,
                         return_lse, seqused_k, out_dtype, qk_format=qk_format, p_format=p_format)


@_attention_fp8_full.register_fake
def _attention_fp8_full_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q,
                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks,
                             return_lse, seqused_k=None, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    return _fake_sequence(True, (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, mid_window_blocks, return_lse,
                          seqused_k, out_dtype, qk_format, p_format)
