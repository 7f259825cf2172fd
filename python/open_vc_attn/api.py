"""GPU API of open_vc_attn: FP8 ExpCast attention on torch CUDA tensors (Hopper, sm_90a only).

- :func:`prepare_fp8` quantizes BF16/FP16 ``q, k, v`` into a :class:`PreparedFP8` (E4M3 codes, descales,
  packed V; docs/numerics.md section 1), batched ``[B, S, H, D]`` or packed variable-length sequences
  (``cu_seqlens_q/k``).
- :meth:`PreparedFP8.from_quantized` wraps tensors that were quantized elsewhere (e.g. prepared before a
  sequence-parallel all-to-all) after checking their dtypes, shapes, layout and device.
- :func:`attention_fp8` runs ExpCast attention on a batched :class:`PreparedFP8` (sections 2-5): BF16
  output of q's shape, optionally the natural-log LSE, optionally causal.
- :func:`attention` does both in one call, for batched or packed (cu_seqlens) inputs, causal or not,
  head_dim 128 or 64; ``version="reference", mode="bf16"`` runs torch SDPA in BF16 instead (A/B runs).

Two kernels sit behind these: the sm_90a fast path (head_dim 128, non-causal, batched) and the general
path (everything else: causal, packed sequences, head_dim 64), with the same numerics contract.

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
import math
import numbers
from typing import Any

__all__ = ["PreparedFP8", "prepare_fp8", "attention_fp8", "attention"]

QUANT_BLOCK = 128            # tokens per Q/K descale group and per packed-V padding unit
KERNEL_HEAD_DIM = 128        # the only head dim of the sm_90a fast path
PREPARE_HEAD_DIMS = (128, 64)  # prepare_fp8, and the general path of attention / attention_fp8
VERSIONS = {"open-vc": "expcast", "reference": "bf16"}   # version -> its one mode
NATURAL_ORDER = -1           # C++ openvc::kNaturalOrder
_INT_MAX = 2**31 - 1         # sizes and mid_window_blocks are C++ ints


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedFP8:
    """Prepared FP8 inputs (docs/numerics.md section 1), all contiguous tensors on one CUDA device.

    q_codes uint8 [B, Sq, H, D] (E4M3), q_descale float32 [B, H, ceil(Sq/128)], k_codes uint8
    [B, Sk, H, D], k_descale float32 [B, H, ceil(Sk/128)], v_packed uint8 [B, H, D, ceil(Sk/128)*128]
    (keys permuted per 16-key group, see ``_openvc_ext.PACKED_KEY_ORDER``), v_descale float32 [B, H].
    B is 1 for a rank-3 input (``input_rank`` 3); ``dtype`` is the torch dtype of the inputs; D is 128 or 64.
    Reusable: several :func:`attention_fp8` calls may share one preparation.

    Packed variable-length sequences (``is_varlen``: prepare_fp8 with cu_seqlens): ``cu_seqlens_q/k`` are
    the caller's int32 offset tensors, batch is the sequence count N, seqlen_q/seqlen_k the max_seqlen_q/k
    given, input_rank 3, and the tensors are q_codes [total_q, H, D], q_descale [N, H, ceil(max_q/128)],
    k_codes [total_k, H, D], k_descale [N, H, ceil(max_k/128)] (0 past a sequence's end), v_packed
    [N, H, D, ceil(max_k/128)*128] (each sequence from column 0 of its own slab, zero padding) and
    v_descale [N, H]. :func:`attention_fp8` does not take them (:func:`attention` with cu_seqlens does).
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

    @property
    def device(self):
        return self.q_codes.device

    @property
    def is_varlen(self) -> bool:
        """True for a preparation of packed variable-length sequences (cu_seqlens)."""
        return self.cu_seqlens_q is not None or self.cu_seqlens_k is not None

    def tensors(self) -> tuple:
        """The six tensors in the argument order of ``torch.ops.open_vc_attn.attention_fp8``."""
        return (self.q_codes, self.q_descale, self.k_codes, self.k_descale, self.v_packed, self.v_descale)

    @classmethod
    def from_quantized(cls, q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, *, input_rank=4,
                       dtype=None) -> "PreparedFP8":
        """A :class:`PreparedFP8` over tensors quantized elsewhere (for instance by :func:`prepare_fp8` on
        another rank, before a sequence-parallel all-to-all), for :func:`attention_fp8`.

        input_rank 4: q_codes [B, Sq, H, D], q_descale [B, H, ceil(Sq/128)], k_codes [B, Sk, H, D],
        k_descale [B, H, ceil(Sk/128)], v_packed [B, H, D, ceil(Sk/128)*128], v_descale [B, H].
        input_rank 3 (one sequence; attention_fp8 then returns [Sq, H, D]): the same without the B axis.
        Codes are torch.uint8 or torch.float8_e4m3fn (E4M3 bytes), descales torch.float32; every tensor
        contiguous, on one CUDA device. v_packed must be in the packed layout of prepare_fp8 (per head,
        dims by keys, keys permuted inside each 16-key group by ``_openvc_ext.PACKED_KEY_ORDER``, zero
        padding), not token-major V codes. ``dtype`` (torch.bfloat16 or torch.float16, default bfloat16)
        records the dtype the inputs had; it does not change the results. Nothing is copied: the result
        holds uint8 views of the given tensors. B, Sq, Sk, H, D are read from q_codes and k_codes; a bad
        argument raises TypeError / ValueError naming it and what was expected.
        """
        return _from_quantized(cls, (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), input_rank,
                               dtype)


# ---- argument checking (plain Python over tensor metadata: torch.compile traces it into guards) -------

def _torch():
    import torch
    return torch


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _require_tensors(q, k, v):
    torch = _torch()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (CUDA, bfloat16 or float16), got {type(x).__name__}")


def _check_tokens(q, k, v, head_dims=PREPARE_HEAD_DIMS, caller="prepare_fp8"):
    """Checks q, k, v of prepare_fp8 / attention; returns rank-4 views and q's rank. Never copies.
    The device comes last, so that every other check can be exercised with CPU tensors."""
    torch = _torch()
    _require_tensors(q, k, v)
    rank = q.dim()
    if rank not in (3, 4):
        raise ValueError(f"q: expected rank 4 [B, Sq, H, D] or rank 3 [Sq, H, D], got shape {_shape(q)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != rank and not (rank == 3 and x.dim() == 4):
            raise ValueError(f"{name}: expected rank {rank} like q ([B, Sk, H, D]"
                             f"{' or [Sk, H, D]' if rank == 3 else ''}), got shape {_shape(x)}")
    q4 = q.unsqueeze(0) if rank == 3 else q
    k4 = k.unsqueeze(0) if k.dim() == 3 else k
    v4 = v.unsqueeze(0) if v.dim() == 3 else v
    if k4.shape[0] != q4.shape[0]:
        raise ValueError(f"k: expected batch {q4.shape[0]} like q"
                         f"{' (rank-3 q is one sequence)' if rank == 3 else ''}, got shape {_shape(k)}")
    if k4.shape[2] != q4.shape[2]:
        raise ValueError(f"k: expected {q4.shape[2]} heads like q, got shape {_shape(k)}: GQA/MQA (unequal "
                         "head counts) is not supported; repeat k and v's heads to q's head count")
    if k4.shape[3] != q4.shape[3]:
        raise ValueError(f"k: expected head_dim {q4.shape[3]} like q, got shape {_shape(k)}")
    if v4.shape != k4.shape:
        raise ValueError(f"v: expected the shape of k {_shape(k)}, got {_shape(v)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q (mixed dtypes are not supported), got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.numel() == 0:
            raise ValueError(f"{name}: expected non-empty dims (at least one batch, token and head), got shape "
                             f"{_shape(x)}")
        for size in x.shape:
            if size > _INT_MAX:
                raise ValueError(f"{name}: dims must be < 2^31 (C++ ints), got shape {_shape(x)}")
    if q4.shape[3] not in head_dims:
        raise ValueError(f"q: head_dim {q4.shape[3]} is not supported: {caller} takes "
                         f"{' or '.join(str(d) for d in head_dims)}, got shape {_shape(q)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only "
                             "(detach it, or call under torch.no_grad() / torch.inference_mode())")
    for name, x in (("q", q4), ("k", k4), ("v", v4)):
        _check_token_strides(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {x.device}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {x.device}")
    return q4, k4, v4, rank


def _check_token_strides(name, x):
    """Head dim contiguous; the other strides are free but must be multiples of 8 elements (16 bytes),
    as the kernels load 16-byte vectors. Strides of size-1 dims never matter and are not checked."""
    strides = x.stride()
    if x.shape[3] > 1 and strides[3] != 1:
        raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(strides)}; "
                         "call .contiguous() first (openvc never copies silently)")
    for axis, what in ((0, "batch"), (1, "sequence"), (2, "head")):
        if x.shape[axis] > 1 and strides[axis] % 8 != 0:
            raise ValueError(f"{name}: the {what} stride must be a multiple of 8 elements (16 bytes) for the "
                             f"kernels' vector loads, got strides {tuple(strides)}; call .contiguous() first")


def _fp8_expectations(b, sq, sk, h, d):
    """name -> (shape, dtype name) of the six prepared tensors."""
    nq, nk = (sq + QUANT_BLOCK - 1) // QUANT_BLOCK, (sk + QUANT_BLOCK - 1) // QUANT_BLOCK
    return (("q_codes", (b, sq, h, d), "uint8"), ("q_descale", (b, h, nq), "float32"),
            ("k_codes", (b, sk, h, d), "uint8"), ("k_descale", (b, h, nk), "float32"),
            ("v_packed", (b, h, d, nk * QUANT_BLOCK), "uint8"), ("v_descale", (b, h), "float32"))


def _check_fp8_tensors(tensors, prefix, sizes=None):
    """Checks the six prepared tensors (order of PreparedFP8.tensors()) against each other, or against
    sizes = (B, Sq, Sk, H, D) when given; returns (B, Sq, Sk, H, D). prefix names them in messages."""
    torch = _torch()
    names = [e[0] for e in _fp8_expectations(1, 1, 1, 1, 1)]
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
    if sizes is None:
        qc, kc = tensors[0], tensors[2]
        if qc.dim() != 4 or kc.dim() != 4:
            bad = ("q_codes", qc) if qc.dim() != 4 else ("k_codes", kc)
            raise ValueError(f"{prefix}{bad[0]}: expected rank 4 [B, S, H, D], got shape {_shape(bad[1])}")
        sizes = (qc.shape[0], qc.shape[1], kc.shape[1], qc.shape[2], qc.shape[3])
    b, sq, sk, h, d = sizes
    _check_fixed_layouts(_fp8_expectations(b, sq, sk, h, d), tensors, prefix, sizes)
    if min(sizes) < 1 or max(sizes) > _INT_MAX:
        raise ValueError(f"{prefix}q_codes: sizes B, Sq, Sk, H, D must be in [1, 2^31), got {tuple(sizes)}")
    _check_one_cuda_device(names, tensors, prefix)
    return b, sq, sk, h, d


def _check_fixed_layouts(expectations, tensors, prefix, sizes):
    """Each tensor against its (name, shape, dtype) expectation: dtype, shape, contiguity (the kernels'
    fixed layouts), no grad. sizes (B, Sq, Sk, H, D) only name the shapes in messages."""
    torch = _torch()
    b, sq, sk, h, d = sizes
    for (name, shape, dtype), x in zip(expectations, tensors):
        if x.dtype != getattr(torch, dtype):
            raise TypeError(f"{prefix}{name}: expected dtype torch.{dtype}, got {x.dtype}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{prefix}{name}: expected shape {tuple(shape)} for B={b} Sq={sq} Sk={sk} H={h} "
                             f"D={d}, got {_shape(x)}")
        if not x.is_contiguous():
            raise ValueError(f"{prefix}{name}: expected a contiguous tensor (the kernel's fixed layout), got "
                             f"strides {tuple(x.stride())} for shape {_shape(x)}")
        if x.requires_grad:
            raise ValueError(f"{prefix}{name}: requires_grad=True is not supported: openvc is inference-only")


def _check_one_cuda_device(names, tensors, prefix):
    """Every tensor on the first one's CUDA device. Checked last, so the other checks also work on CPU
    and meta tensors (fake implementations, error tests)."""
    dev = tensors[0].device
    for name, x in zip(names, tensors):
        if x.device.type != "cuda" or x.device != dev:
            raise ValueError(f"{prefix}{name}: expected a CUDA tensor on {prefix}q_codes's device {dev}, got {x.device}")


def _prepared_meta(prepared) -> dict:
    """Sizes, input rank and dtype of a prepared object (PreparedFP8, PreparedVC), checked: the ints
    batch, seqlen_q, seqlen_k, heads, head_dim and input_rank as a dict."""
    torch = _torch()
    meta = {}
    for field in ("batch", "seqlen_q", "seqlen_k", "heads", "head_dim", "input_rank"):
        val = getattr(prepared, field)
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"prepared.{field}: expected an int >= 1, got {val!r}")
        meta[field] = int(val)
    if meta["input_rank"] not in (3, 4) or (meta["input_rank"] == 3 and meta["batch"] != 1):
        raise ValueError(f"prepared.input_rank: expected 4, or 3 with batch 1, got {meta['input_rank']} "
                         f"(batch {meta['batch']})")
    if prepared.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"prepared.dtype: expected torch.bfloat16 or torch.float16, got {prepared.dtype}")
    return meta


def _check_prepared(prepared):
    if not isinstance(prepared, PreparedFP8):
        raise TypeError(f"prepared: expected a PreparedFP8 from open_vc_attn.prepare_fp8, got {type(prepared).__name__}")
    if prepared.is_varlen:
        raise ValueError("prepared: packed variable-length sequences (cu_seqlens) are not supported yet by "
                         "attention_fp8, which takes batched [B, S, H, D] preparations only; attend packed "
                         "sequences with open_vc_attn.attention(q, k, v, cu_seqlens_q=..., cu_seqlens_k=...)")
    meta = _prepared_meta(prepared)
    if meta["head_dim"] not in PREPARE_HEAD_DIMS:
        raise ValueError(f"prepared.head_dim: attention_fp8 supports head_dim 128 or 64, got {meta['head_dim']}")
    sizes = (meta["batch"], meta["seqlen_q"], meta["seqlen_k"], meta["heads"], meta["head_dim"])
    _check_fp8_tensors(prepared.tensors(), "prepared.", sizes)
    return meta


_FP8_LAYOUTS = ("[B, Sq, H, D]", "[B, H, ceil(Sq/128)]", "[B, Sk, H, D]", "[B, H, ceil(Sk/128)]",
                "[B, H, D, ceil(Sk/128)*128]", "[B, H]")


def _from_quantized(cls, tensors, input_rank, dtype):
    """PreparedFP8.from_quantized: checks in the order kind, dtype, rank, sizes, layout, device (last, as in
    _check_tokens, so that every other check can be exercised with CPU or meta tensors)."""
    torch = _torch()
    names = [e[0] for e in _fp8_expectations(1, 1, 1, 1, 1)]
    if isinstance(input_rank, bool) or not isinstance(input_rank, numbers.Integral) or input_rank not in (3, 4):
        raise ValueError(f"input_rank: expected 4 ([B, S, H, D] tensors) or 3 (one sequence: the same without "
                         f"the batch axis), got {input_rank!r}")
    input_rank = int(input_rank)
    if dtype is None:
        dtype = torch.bfloat16
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected None, torch.bfloat16 or torch.float16 (the dtype of the inputs before "
                         f"quantization), got {dtype!r}")
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for name, x in zip(names, tensors):
        if name.endswith("descale"):
            if x.dtype != torch.float32:
                raise TypeError(f"{name}: expected dtype torch.float32, got {x.dtype}")
        elif x.dtype != torch.uint8 and (fp8 is None or x.dtype != fp8):
            raise TypeError(f"{name}: expected dtype torch.uint8 or torch.float8_e4m3fn (E4M3 codes), got {x.dtype}")
    drop = 4 - input_rank   # rank 3: no batch axis
    layouts = [lay.replace("B, ", "") if drop else lay for lay in _FP8_LAYOUTS]
    for name, x, lay in zip(names, tensors, layouts):
        want = lay.count(",") + 1
        if x.dim() != want:
            raise ValueError(f"{name}: expected rank {want} {lay} (input_rank={input_rank}), got shape {_shape(x)}")
    t4 = [x.unsqueeze(0) if drop else x for x in tensors]
    qc, kc = t4[0], t4[2]
    b, sq, h, d = (int(n) for n in qc.shape)
    bk, sk, hk, dk = (int(n) for n in kc.shape)
    if min(b, sq, h, d) < 1 or min(sk, hk, dk) < 1:
        bad = ("q_codes", tensors[0]) if min(b, sq, h, d) < 1 else ("k_codes", tensors[2])
        raise ValueError(f"{bad[0]}: expected non-empty dims, got shape {_shape(bad[1])}")
    if max(b, sq, sk, h, d) > _INT_MAX:
        raise ValueError(f"q_codes: sizes B, Sq, Sk, H, D must be < 2^31, got {(b, sq, sk, h, d)}")
    if bk != b:
        raise ValueError(f"k_codes: expected batch {b} like q_codes, got shape {_shape(tensors[2])}")
    if hk != h:
        raise ValueError(f"k_codes: expected {h} heads like q_codes (GQA/MQA is not supported), got shape "
                         f"{_shape(tensors[2])}")
    if dk != d:
        raise ValueError(f"k_codes: expected head_dim {d} like q_codes, got shape {_shape(tensors[2])}")
    if d not in PREPARE_HEAD_DIMS:
        raise ValueError(f"q_codes: head_dim {d} is not supported: expected 128 or 64, got shape "
                         f"{_shape(tensors[0])}")
    sizes_txt = f"{'' if drop else f'B={b} '}Sq={sq} Sk={sk} H={h} D={d}"
    for (name, shape, _), x, lay in zip(_fp8_expectations(b, sq, sk, h, d), tensors, layouts):
        want = tuple(shape[drop:])
        if _shape(x) != want:
            hint = (" (the packed V layout of prepare_fp8; token-major [B, Sk, H, D] V codes are not accepted)"
                    if name == "v_packed" else "")
            raise ValueError(f"{name}: expected shape {want} = {lay} for {sizes_txt}{hint}, got {_shape(x)}")
    for name, x in zip(names, tensors):
        if not x.is_contiguous():
            hint = (" (a permuted view of token-major V codes is not the packed layout)" if name == "v_packed"
                    else "")
            raise ValueError(f"{name}: expected a contiguous tensor (the kernel's fixed layout){hint}, got strides "
                             f"{tuple(x.stride())} for shape {_shape(x)}")
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only")
    dev = tensors[0].device
    if dev.type != "cuda":
        raise ValueError(f"q_codes: expected a CUDA tensor, got device {dev}")
    for name, x in zip(names[1:], tensors[1:]):
        if x.device != dev:
            raise ValueError(f"{name}: expected a CUDA tensor on q_codes's device {dev}, got {x.device}")
    t4 = [x.view(torch.uint8) if x.dtype != torch.uint8 and x.dtype != torch.float32 else x for x in t4]
    _check_fp8_tensors(t4, "", (b, sq, sk, h, d))   # the layout attention_fp8 checks again
    return cls(*t4, batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, head_dim=d, input_rank=input_rank, dtype=dtype)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Checks the packed-sequence arguments of prepare_fp8 (q, k, v [total, H, D]) and returns the sequence
    count. The offsets are never read: no device-to-host copy, so the call stays graph-capturable."""
    torch = _torch()
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, cu in cus:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 CUDA tensor of N + 1 offsets (packed sequences need both "
                            f"cu_seqlens_q and cu_seqlens_k), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected a 1-D tensor of N + 1 >= 2 offsets, got shape {_shape(cu)}")
        if not cu.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got stride {tuple(cu.stride())}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} offsets like cu_seqlens_q (one per "
                         f"sequence, plus one), got {cu_seqlens_k.shape[0]}")
    nseq = int(cu_seqlens_q.shape[0]) - 1
    if nseq > _INT_MAX:
        raise ValueError(f"cu_seqlens_q: at most 2^31 - 1 sequences, got {nseq}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # torch.SymInt: the fake implementation of the op under torch.compile with dynamic shapes.
        if m is None or isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name}: expected a Python int >= 1 with cu_seqlens (the longest sequence, or an "
                            f"upper bound; it is never computed from the device offsets), got {type(m).__name__}")
        if not 1 <= m <= _INT_MAX:
            raise ValueError(f"{name}: expected an int in [1, 2^31), got {m}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.dim() != 3:
            total = "total_q" if name == "q" else "total_k"
            raise ValueError(f"{name}: packed sequences (cu_seqlens) need rank 3 [{total}, H, D], got shape "
                             f"{_shape(x)}")
    _check_tokens(q, k, v)     # dtypes, heads, head dim, strides, q's device
    for name, cu in cus:
        if cu.device != q.device:
            raise ValueError(f"{name}: expected a CUDA tensor on q's device {q.device}, got {cu.device}")
    return nseq


def _softmax_scale(x) -> float:
    if x is None:
        return 0.0   # the C++ default: 1/sqrt(D)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"softmax_scale: expected None or a float > 0, got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"softmax_scale: expected None or a finite float > 0, got {x}")
    return x


def _mid_window(x) -> int:
    if x is None:
        return NATURAL_ORDER
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"mid_window_blocks: expected None (natural order) or an int >= 0, got {type(x).__name__}")
    if not 0 <= x <= _INT_MAX:
        raise ValueError(f"mid_window_blocks: expected None (natural order) or an int in [0, 2^31), got {x}")
    return int(x)


def _bool_arg(x, name) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def _return_lse(x) -> bool:
    return _bool_arg(x, "return_lse")


def _version(version, mode) -> str:
    """Checks version and mode; returns the version ("open-vc" or "reference")."""
    modes = sorted(set(VERSIONS.values()))
    for name, x, allowed in (("version", version, sorted(VERSIONS)), ("mode", mode, modes)):
        if not isinstance(x, str):
            raise TypeError(f"{name}: expected a str, one of {allowed}, got {type(x).__name__}")
        if x not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {x!r}")
    if VERSIONS[version] != mode:
        raise ValueError(f"mode: version={version!r} runs mode={VERSIONS[version]!r} only, got mode={mode!r} "
                         "(FP8 ExpCast is version='open-vc', mode='expcast'; the BF16 SDPA baseline is "
                         "version='reference', mode='bf16')")
    return version


def _max_seqlen(given, cu):
    """max_seqlen_q/k: the given value, or the longest sequence read from the offsets (one device-to-host
    copy, i.e. a synchronization; documented) when it is None and cu is a usable offset tensor. Anything
    unusable is left to _check_varlen, which names it."""
    torch = _torch()
    if given is not None or not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2 \
            or cu.dtype != torch.int32:
        return given
    return max(1, int((cu[1:] - cu[:-1]).max()))


def _fast_path(d, causal, varlen, sq, sk) -> bool:
    """The sm_90a fast path takes head_dim 128, non-causal, batched, and ceil(Sq/128) * Sk < 2^32."""
    return not varlen and not causal and d == KERNEL_HEAD_DIM and -(-sq // QUANT_BLOCK) * sk < 2**32


def _run_attention(tensors, rank, softmax_scale, mid_window_blocks, return_lse, causal=False, varlen=None):
    """Runs the fast or the general path on prepared tensors. varlen: (cu_q, cu_k, max_q, max_k) or None."""
    from . import ops  # registers the custom ops (imports torch) on first use
    qc, kc = tensors[0], tensors[2]
    if _fast_path(int(qc.shape[-1]), causal, varlen is not None, qc.shape[-3], kc.shape[-3]):
        out, lse = ops.attention_fp8_op(*tensors, softmax_scale, mid_window_blocks, return_lse)
    else:
        cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
        out, lse = ops.attention_general_op(*tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                            mid_window_blocks, return_lse)
    if rank == 3 and varlen is None:  # one sequence: drop the batch axis again (views, no copy)
        out, lse = out[0], (lse[0] if return_lse else lse)
    return (out, lse) if return_lse else out


# ---- public functions ---------------------------------------------------------------------------------

def prepare_fp8(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None) -> PreparedFP8:
    """Quantizes ``q, k, v`` for :func:`attention_fp8` (docs/numerics.md section 1).

    q: [B, Sq, H, D] or [Sq, H, D] (one sequence); k, v: [B, Sk, H, D] (or [Sk, H, D] with a rank-3 q).
    bfloat16 or float16 CUDA tensors of one dtype and device; D 128 or 64. The head dim must be
    contiguous; the other strides may be anything that is a multiple of 8 elements, and the data
    16-byte aligned (nothing is copied to fix a layout). The outputs are new tensors.

    Packed variable-length sequences: q [total_q, H, D], k and v [total_k, H, D], with cu_seqlens_q and
    cu_seqlens_k int32 CUDA tensors of N + 1 offsets (cu[0] = 0, non-decreasing, cu[N] <= total) and
    max_seqlen_q / max_seqlen_k Python ints >= every sequence's length (an upper bound is fine). The offsets
    are read on the GPU only (no synchronization: their values are not checked). Each sequence is quantized
    separately; see :class:`PreparedFP8` for the output layout. :func:`attention_fp8` does not take such a
    preparation yet (:func:`attention` with cu_seqlens attends packed sequences).
    """
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if any(x is not None for x in varlen):
        if cu_seqlens_q is None and cu_seqlens_k is None:
            name = "max_seqlen_q" if max_seqlen_q is not None else "max_seqlen_k"
            raise ValueError(f"{name}: only used with cu_seqlens_q and cu_seqlens_k (packed sequences), which are "
                             "None")
        _check_varlen(q, k, v, *varlen)
        from . import ops
        tensors = ops.prepare_fp8_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return PreparedFP8(*tensors, batch=int(cu_seqlens_q.shape[0]) - 1, seqlen_q=int(max_seqlen_q),
                           seqlen_k=int(max_seqlen_k), heads=int(q.shape[1]), head_dim=int(q.shape[2]),
                           input_rank=3, dtype=q.dtype, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    q4, k4, v4, rank = _check_tokens(q, k, v)
    from . import ops
    tensors = ops.prepare_fp8_op(q4, k4, v4)
    b, sq, h, d = (int(s) for s in q4.shape)
    return PreparedFP8(*tensors, batch=b, seqlen_q=sq, seqlen_k=int(k4.shape[1]), heads=h, head_dim=d,
                       input_rank=rank, dtype=q.dtype)


def attention_fp8(prepared, *, softmax_scale=None, causal=False, mid_window_blocks=4, return_lse=False):
    """ExpCast FP8 attention on a batched preparation (docs/numerics.md sections 2-5).

    softmax_scale None means 1/sqrt(D). causal: key j visible to query i iff j <= i + (Sk - Sq).
    mid_window_blocks: the key traversal of section 5 (None: natural order). Returns out, bfloat16 in q's
    shape ([B, Sq, H, D] or [Sq, H, D]); with return_lse, (out, lse) where lse is float32 natural-log
    [B, H, Sq] ([H, Sq] for a rank-3 q). head_dim 128 non-causal runs the sm_90a fast path, everything
    else the general path. Packed (cu_seqlens) preparations are not taken: use :func:`attention`.
    """
    scale, mid, want_lse = _softmax_scale(softmax_scale), _mid_window(mid_window_blocks), _return_lse(return_lse)
    causal = _bool_arg(causal, "causal")
    meta = _check_prepared(prepared)
    return _run_attention(prepared.tensors(), meta["input_rank"], scale, mid, want_lse, causal)


def attention(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, mid_window_blocks=4,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, version="open-vc",
              mode="expcast"):
    """Attention of q, k, v: :func:`prepare_fp8` then ExpCast FP8 attention in one call (the FP8
    intermediates are freed on return), or a BF16 SDPA baseline (``version="reference", mode="bf16"``).

    Batched: q [B, Sq, H, D] or [Sq, H, D]; k, v [B, Sk, H, D] (or [Sk, H, D] with a rank-3 q).
    Packed sequences: q [total_q, H, D], k and v [total_k, H, D] with cu_seqlens_q / cu_seqlens_k (int32
    CUDA tensors of N + 1 offsets; each sequence is quantized and attended separately). max_seqlen_q /
    max_seqlen_k: Python ints >= every sequence's length; when omitted they are read from the offsets,
    which costs one device-to-host synchronization (and so breaks CUDA graph capture and
    torch.compile(fullgraph=True)): pass them there. bfloat16 or float16, head_dim 128 or 64.

    softmax_scale None means 1/sqrt(D). causal: key j of a sequence is visible to its query i iff
    j <= i + (Sk - Sq) (aligned to the end); a row that sees no key gives output 0 and lse -inf.
    mid_window_blocks: key traversal (numerics.md section 5; None: natural order). Returns out, bfloat16
    in q's shape, or (out, lse) with return_lse: float32 natural-log LSE [B, H, Sq] ([H, Sq] for rank 3,
    [H, total_q] for packed sequences).
    """
    version = _version(version, mode)
    scale, mid, want_lse = _softmax_scale(softmax_scale), _mid_window(mid_window_blocks), _return_lse(return_lse)
    causal = _bool_arg(causal, "causal")
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            name = "max_seqlen_q" if max_seqlen_q is not None else "max_seqlen_k"
            raise ValueError(f"{name}: only used with cu_seqlens_q and cu_seqlens_k (packed sequences), which are "
                             "None")
        q4, k4, v4, rank = _check_tokens(q, k, v, caller="attention")
        if version == "reference":
            from . import _sdpa
            return _sdpa.attention_bf16(q4, k4, v4, scale, causal, want_lse, rank)
        from . import ops
        return _run_attention(ops.prepare_fp8_op(q4, k4, v4), rank, scale, mid, want_lse, causal)
    max_q, max_k = _max_seqlen(max_seqlen_q, cu_seqlens_q), _max_seqlen(max_seqlen_k, cu_seqlens_k)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    if version == "reference":
        from . import _sdpa
        return _sdpa.attention_bf16_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, want_lse)
    from . import ops
    tensors = ops.prepare_fp8_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    return _run_attention(tensors, 3, scale, mid, want_lse, causal, (cu_seqlens_q, cu_seqlens_k, max_q, max_k))
