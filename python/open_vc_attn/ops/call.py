"""The custom op of :func:`open_vc_attn.attention`: one op, one C++ call (openvc::attention, include/openvc/call.h).

``open_vc_attn::attention(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k,
int max_seqlen_q, int max_seqlen_k, Tensor? seqused_k, float softmax_scale, bool causal, int mid_window_blocks,
bool return_lse, ScalarType? out_dtype=None, str qk_format="e4m3", bool k_smoothing=False,
str p_format="expcast", Tensor? kv_num_blocks=None, Tensor? kv_indices=None, int causal_chunk=1,
bool v_bias_correction=False) -> (out, lse)``:
BF16/FP16 CUDA q, k, v, batched ``[B, S, H, D]`` (offsets None) or
packed ``[total, H, D]`` with int32 offsets; out ``[B, Sq, H, D]`` / ``[total_q, H, D]`` (BF16, or out_dtype;
packed rows no sequence covers are 0), lse float32 ``[B, H, Sq]`` / ``[H, total_q]`` (-inf there), or an
empty ``[0]`` tensor without return_lse. softmax_scale <= 0 means 1/sqrt(D); mid_window_blocks -1 natural
order. C++ prepares into one workspace tensor and attends on the fast or the general path, chosen there;
with k_smoothing the LSE is that of the keys as given (numerics section 9). kv_num_blocks / kv_indices: key
block lists (block-sparse attention, batched calls on the fast path; open_vc_attn.masks.check_block_lists's
layout, contiguous; docs/block_sparse.md). causal_chunk: chunked causal (with causal; numerics section 5).
k and v may hold Hk heads, a divisor of q's H (GQA/MQA: ``[B, Sk, Hk, D]`` / ``[total_k, Hk, D]``,
AttentionCall::kv_heads), on the fast path only: a call the general path would take raises ValueError naming k.
v_bias_correction: V's mean rounding error added back per channel (numerics section 4, "V rounding bias"), with
qk_format "int8" and without key block lists (ValueError naming v_bias_correction otherwise).

Python allocates the outputs and the workspace and fills the call's struct; the argument rules that need
torch (dtypes, devices, ranks, alignment) run here, the rest in C++. :func:`open_vc_attn.api.attention`
calls :func:`attention` below, which runs this op's implementation directly when nothing but the kernels
needs to see the call (:func:`.direct.run`), else the op; the op checks the arguments (api.attention only
shapes them: rank-3 views, defaults).
"""
import torch

from .. import _checks, _ext, _gqa
from . import device as dev
from .direct import run
from .fp8 import sequence_outputs

_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
           "int max_seqlen_k, Tensor? seqused_k, float softmax_scale, bool causal, int mid_window_blocks, "
           "bool return_lse, ScalarType? out_dtype=None, str qk_format=\"e4m3\", bool k_smoothing=False, "
           "str p_format=\"expcast\", Tensor? kv_num_blocks=None, Tensor? kv_indices=None, int causal_chunk=1, "
           "bool v_bias_correction=False) -> (Tensor, Tensor)")


def _check(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, qk_format, k_smoothing, p_format, blocks=(None, None),
           causal=False, causal_chunk=1, v_bias_correction=False):
    """The op's argument rules (api.attention leaves them to the op; C++ checks its struct on its own):
    whether the call is packed. blocks: (kv_num_blocks, kv_indices) or (None, None)."""
    fmt, _ = _checks.qk_format(qk_format), _checks.k_smoothing(k_smoothing)
    _checks.p_format(p_format, fmt)
    _checks.causal_chunk(causal_chunk, causal)
    packed = cu_q is not None or cu_k is not None
    if packed:
        groups = _checks.check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        reason = _checks.general_path_reason(int(q.shape[-1]), max_q, max_k)
    else:
        _checks.check_rank4_tokens("attention", q, k, v, caller="attention", gqa=True)
        groups = int(q.shape[0])
        reason = _checks.general_path_reason(int(q.shape[-1]), int(q.shape[1]), int(k.shape[1]))
    _checks.require_fast_path(fmt, reason)
    _gqa.require_fast_path(int(q.shape[-2]), int(k.shape[-2]), reason)   # C++ would answer Unsupported
    # INT8 only, so the fast path only (require_fast_path above)
    _checks.v_bias_correction(v_bias_correction, fmt, blocks[0] is not None or blocks[1] is not None)
    if reason is not None:   # C++ takes the general path there, whose grid bounds batches and heads
        _checks.check_general_grid(groups, int(q.shape[-2]), ("cu_seqlens_q" if packed else "q", "q"), packed)
    _checks.check_seqused_k(seqused_k, groups, q.device, "sequences" if packed else "batch entries")
    if blocks[0] is not None or blocks[1] is not None:
        from .._block_sparse import check_op_lists
        check_op_lists(*blocks, q, k, packed=packed, causal=causal, key_counts=seqused_k is not None, p_format=p_format)
    return packed


def _sizes(q, packed):
    """(N, Sq, Sk, H, D) as fp8.sequence_outputs reads them (packed: Sq is total_q; N and Sk unused there),
    which gives the outputs: packed out [total_q, H, D] zeros and lse [H, total_q] -inf (rows no sequence
    covers stay so), batched [B, Sq, H, D] and [B, H, Sq], every element written."""
    if packed:
        total, h, d = (int(x) for x in q.shape)
        return 0, total, 0, h, d
    b, sq, h, d = (int(x) for x in q.shape)
    return b, sq, 0, h, d


def _call_struct(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, softmax_scale, causal, mid_window_blocks, out, lse,
                 qk_format, k_smoothing, p_format, blocks=(None, None), causal_chunk=1, v_bias_correction=False):
    """openvc::AttentionCall of checked arguments (lse None: no LSE output; kv_heads where k has fewer heads)."""
    ext = _ext.load()
    packed = cu_q is not None
    c = dev.params(ext.AttentionCall, dtype=dev.dtype_of(q), heads=int(q.shape[-2]), head_dim=int(q.shape[-1]),
                   q=dev.token_view(q, packed), k=dev.token_view(k, packed), v=dev.token_view(v, packed),
                   causal=bool(causal), causal_chunk=int(causal_chunk), softmax_scale=float(softmax_scale),
                   mid_window_blocks=int(mid_window_blocks),
                   qk_format=dev.qk_format(qk_format), k_smoothing=bool(k_smoothing),
                   p_format=getattr(ext.PFormat, p_format), out=out.data_ptr(), out_dtype=dev.dtype_of(out),
                   lse=0 if lse is None else lse.data_ptr(), v_bias_correction=bool(v_bias_correction))
    if packed:
        c.cu_seqlens_q, c.cu_seqlens_k, c.num_seqs = cu_q.data_ptr(), cu_k.data_ptr(), int(cu_q.shape[0]) - 1
        c.max_seqlen_q, c.max_seqlen_k, c.total_q, c.total_k = int(max_q), int(max_k), int(q.shape[0]), int(k.shape[0])
        c.out_stride_batch, c.out_stride_seq, c.out_stride_head = 0, *out.stride()[:2]
    else:
        c.batch, c.seqlen_q, c.seqlen_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        c.out_stride_batch, c.out_stride_seq, c.out_stride_head = out.stride()[:3]
    if seqused_k is not None:
        c.seqused_k = seqused_k.data_ptr()
    if int(k.shape[-2]) != c.heads:   # GQA/MQA (the struct's 0: equal head counts)
        c.kv_heads = int(k.shape[-2])
    if blocks[0] is not None or blocks[1] is not None:
        counts, indices = blocks
        c.blocks = dev.params(ext.KeyBlockList, num_blocks=counts.data_ptr(), indices=indices.data_ptr(),
                              batch=int(counts.shape[0]), heads=int(counts.shape[1]), q_tiles=int(counts.shape[2]),
                              capacity=int(indices.shape[3]))
    return c


def attention_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                   mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3", k_smoothing=False,
                   p_format="expcast", kv_num_blocks=None, kv_indices=None, causal_chunk=1, v_bias_correction=False):
    """The CUDA implementation of the op (registered as it is): (out, lse)."""
    varlen, blocks = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), (kv_num_blocks, kv_indices)
    packed = _check(q, k, v, *varlen, seqused_k, qk_format, k_smoothing, p_format, blocks, causal, causal_chunk,
                    v_bias_correction)
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    out, lse = sequence_outputs(packed, _sizes(q, packed), return_lse, dev.empty(q.device), dev.full(q.device),
                                out_dtype)
    c = _call_struct(q, k, v, *varlen, seqused_k, softmax_scale, causal, mid_window_blocks, out,
                     lse if return_lse else None, qk_format, k_smoothing, p_format, blocks, causal_chunk,
                     v_bias_correction)
    ext = _ext.load()
    ws = dev.workspace(ext.attention_workspace_bytes(c), q.device)   # torch's blocks are 512-byte aligned
    dev.enqueue(lambda call, stream: ext.attention(call, ws.data_ptr(), ws.numel(), stream), c, q.device)
    return out, lse


_attention = torch.library.custom_op("open_vc_attn::attention", mutates_args=(), device_types="cuda",
                                     schema=_SCHEMA)(attention_cuda)
_OP = torch.ops.open_vc_attn.attention.default


@_attention.register_fake
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale,
                    causal, mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3", k_smoothing=False,
                    p_format="expcast", kv_num_blocks=None, kv_indices=None, causal_chunk=1, v_bias_correction=False):
    packed = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, qk_format,
                    k_smoothing, p_format, (kv_num_blocks, kv_indices), causal, causal_chunk, v_bias_correction)
    return sequence_outputs(packed, _sizes(q, packed), return_lse, dev.like(q), dev.like_full(q), out_dtype)


def attention(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, softmax_scale, causal, mid_window_blocks, return_lse,
              out_dtype=None, qk_format="e4m3", k_smoothing=False, p_format="expcast", kv_num_blocks=None,
              kv_indices=None, causal_chunk=1, v_bias_correction=False):
    """``open_vc_attn::attention``: the op's implementation directly when eager (one hop less), else the op."""
    return run(_OP, attention_cuda, (q, k, v, cu_q, cu_k, seqused_k, kv_num_blocks, kv_indices), q, k, v, cu_q, cu_k,
               max_q, max_k, seqused_k, softmax_scale, causal, mid_window_blocks, return_lse, out_dtype, qk_format,
               k_smoothing, p_format, kv_num_blocks, kv_indices, causal_chunk, v_bias_correction)
