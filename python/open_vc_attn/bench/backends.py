"""Backends the benchmark times, and the ceilings it measures beside them.

A backend is found by import or attribute, never assumed: one that cannot be imported is "missing"
(with the import error), one that imports but fails on the case is "error" (with the message). Each
``build_*`` returns a :class:`Built`: ``fn()`` runs one call (what is timed), ``to_bshd(out)`` turns its
return value into a [B, S, H, D] tensor for the accuracy check (not timed).

Scopes: "attention" times the kernel on inputs prepared beforehand (open-vc: attention_fp8 on a
PreparedFP8; FP8 anchors: already-quantized inputs; BF16 anchors: the plain call). "complete" times BF16
in to BF16 out with every preparation step. BF16 anchors run in the attention scope only, since their
complete scope is the same call (the report compares complete-scope entries against them too).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Callable, Optional

from .._layout import DEFAULT_MID_WINDOW_BLOCKS

# name -> (kind, label, scopes). Order = order of the report's tables.
BACKENDS = {
    "open-vc": ("ours", "openvc FP8 ExpCast", ("attention", "complete")),
    "open-vc-repair": ("ours", "openvc FP8 ExpCast + V repair", ("attention", "complete")),
    "vc": ("baseline", "VC-Attention (V-Smooth + ExpCast)", ("attention", "complete")),
    "sdpa-cudnn": ("anchor", "torch SDPA cuDNN BF16", ("attention",)),
    "sdpa-flash": ("anchor", "torch SDPA flash (FA2) BF16", ("attention",)),
    "fa3-bf16": ("anchor", "FlashAttention-3 BF16", ("attention",)),
    "fa3-fp8": ("anchor", "FlashAttention-3 FP8 e4m3", ("attention", "complete")),
    "fa4-bf16": ("anchor", "FlashAttention-4 (cute) BF16", ("attention",)),
    "cudnn-fp8": ("anchor", "cuDNN FP8 SDPA (frontend)", ("attention", "complete")),
    # Quantization (INT8 Q/K per thread, K smoothing, FP8 PV) is inside its call: complete scope only.
    "sage2": ("anchor", "SageAttention2 (INT8 QK + smooth K, FP8 PV)", ("complete",)),
}
# Backends timed eagerly (CUDA events around back-to-back calls), never from a CUDA graph: SageAttention2's
# launches do not replay from a graph captured on a side stream (its graph timings come out impossibly fast).
EAGER_ONLY = ("sage2",)
# The BF16 output every other output is also compared against: the first of these that ran.
BF16_REFERENCES = ("sdpa-cudnn", "sdpa-flash", "fa3-bf16")
E4M3_MAX = 448.0


class Missing(Exception):
    """The backend is not available here (the message says why: usually the import error)."""


@dataclasses.dataclass
class Built:
    fn: Callable
    to_bshd: Callable = lambda out: out
    note: Optional[str] = None
    params: dict = dataclasses.field(default_factory=dict)
    eager: bool = False   # time with CUDA events around eager calls, never in a CUDA graph


def _first_out(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _import_first(candidates, attr):
    """First module among candidates exposing attr; Missing with every import error otherwise."""
    errors = []
    for name in candidates:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:   # ImportError, or a broken install (OSError on a missing .so)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(mod, attr):
            return mod, name
        errors.append(f"{name}: has no {attr}")
    raise Missing("; ".join(errors))


# ---- ours and the VC baseline ---------------------------------------------------------------------------

def _openvc(*names):
    """The open_vc_attn GPU functions `names`, looked up on the package then on open_vc_attn.api."""
    import open_vc_attn
    api, api_error = None, None
    try:
        api = importlib.import_module("open_vc_attn.api")
    except Exception as exc:
        api_error = f"{type(exc).__name__}: {exc}"
    found = []
    for n in names:
        f = getattr(open_vc_attn, n, None) or getattr(api, n, None)
        if f is None:
            why = f"open_vc_attn.api not importable ({api_error})" if api_error else "not exposed"
            raise Missing(f"not implemented yet (open_vc_attn.{n}: {why})")
        found.append(f)
    return found


def openvc_runtime():
    """Missing unless openvc's kernels can run here: the compiled extension, torch with CUDA and an sm_90
    GPU (the reason comes from the smoke check's probe, so both say the same)."""
    from ..cli import info
    reason = info.gpu_unavailable_reason()
    if reason is not None:
        raise Missing(reason)


def available(name: str) -> tuple:
    """(status, reason) without running anything: ("ok", None) or ("missing", why)."""
    try:
        if name in ("open-vc", "open-vc-repair", "vc"):
            openvc_runtime()
        if name == "open-vc":
            _openvc("prepare_fp8", "attention_fp8", "attention")
        elif name == "open-vc-repair":
            try:
                importlib.import_module("open_vc_attn.repair")
            except Exception as exc:
                raise Missing(f"open_vc_attn.repair not importable: {type(exc).__name__}: {exc}")
        elif name == "vc":
            try:
                baselines = importlib.import_module("open_vc_attn.baselines")
            except Exception as exc:
                raise Missing(f"not implemented yet (open_vc_attn.baselines: {exc})")
            if not hasattr(baselines, "vc_attention"):
                raise Missing("not implemented yet (no open_vc_attn.baselines.vc_attention)")
        elif name in ("sdpa-cudnn", "sdpa-flash"):
            _import_first(["torch.nn.attention"], "sdpa_kernel")
        elif name in ("fa3-bf16", "fa3-fp8"):
            _fa3()
        elif name == "fa4-bf16":
            _fa4()
        elif name == "cudnn-fp8":
            _import_first(["cudnn"], "pygraph")
        elif name == "sage2":
            sage2_function()
        else:
            raise Missing(f"unknown backend {name!r}")
    except Missing as exc:
        return "missing", str(exc)
    except Exception as exc:   # a broken install: still a reason, never a crash
        return "missing", f"{type(exc).__name__}: {exc}"
    return "ok", None


def build_open_vc(inp, scope, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS):
    prepare_fp8, attention_fp8, attention = _openvc("prepare_fp8", "attention_fp8", "attention")
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    params = {"mid_window_blocks": mid_window_blocks}
    if scope == "attention":
        prepared = prepare_fp8(q, k, v)
        return Built(lambda: attention_fp8(prepared, softmax_scale=scale, mid_window_blocks=mid_window_blocks),
                     _first_out, params=params)
    return Built(lambda: attention(q, k, v, softmax_scale=scale, mid_window_blocks=mid_window_blocks),
                 _first_out, params=params)


def build_open_vc_repair(inp, scope, repair_budget=0.005, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS):
    """open_vc_attn.repair: the attention scope times attention_v_repair on a prepared input (FP8
    preparation + selection + repair rows done once); the complete scope times both per call."""
    try:
        from open_vc_attn import repair
    except Exception as exc:
        raise Missing(f"open_vc_attn.repair not importable: {type(exc).__name__}: {exc}")
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    budget = 0.005 if repair_budget is None else float(repair_budget)
    params = {"repair_budget": budget, "mid_window_blocks": mid_window_blocks, "selection": "energy"}

    def attend(prepared):
        return repair.attention_v_repair(prepared, softmax_scale=scale, mid_window_blocks=mid_window_blocks)

    if scope == "attention":
        prepared = repair.prepare_v_repair(q, k, v, budget=budget)
        return Built(lambda: attend(prepared), _first_out, params=params)
    return Built(lambda: attend(repair.prepare_v_repair(q, k, v, budget=budget)), _first_out, params=params)


def build_vc(inp, scope):
    # HOOK: open_vc_attn.baselines does not exist yet; the signature mirrors reference.attention_vc
    # (q, k, v, permutation=None, softmax_scale=...). The attention scope reuses a precomputed
    # grouping, as a sampler would on later denoising steps (numerics.md section 7).
    baselines = importlib.import_module("open_vc_attn.baselines")
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    if scope == "attention":
        if not hasattr(baselines, "vc_grouping"):
            raise Missing("not implemented yet: no open_vc_attn.baselines.vc_grouping (attention scope needs it)")
        perm = baselines.vc_grouping(v)
        return Built(lambda: baselines.vc_attention(q, k, v, permutation=perm, softmax_scale=scale), _first_out)
    return Built(lambda: baselines.vc_attention(q, k, v, softmax_scale=scale), _first_out)


# ---- anchors --------------------------------------------------------------------------------------------

def build_sdpa(inp, scope, which):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[which]
    scale = inp.softmax_scale
    # [B, H, S, D] views of the [B, S, H, D] tensors: the memory our kernel reads, no copies.
    qt, kt, vt = (x.transpose(1, 2) for x in (inp.q, inp.k, inp.v))

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    note = None
    try:
        with torch.no_grad():
            fn()
    except RuntimeError:
        # Some versions want [B, H, S, D]-contiguous inputs: prepare them beforehand (attention scope).
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (inp.q, inp.k, inp.v))
        note = "inputs copied to [B,H,S,D]-contiguous beforehand (strided views rejected)"
    return Built(fn, lambda out: out.transpose(1, 2), note=note)


def _fa3():
    return _import_first(["flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3"],
                         "flash_attn_func")


def fa3_module():
    """The FlashAttention-3 interface module (flash_attn_interface on PYTHONPATH), or Missing."""
    return _fa3()[0]


def _fa4():
    return _import_first(["flash_attn.cute.interface", "flash_attn.cute", "flash_attn_4"], "flash_attn_func")


def quantize_per_head(x, groups=None):
    """[B, S, H, D] -> (e4m3 codes, descale [B, H] float32): amax per (batch, head), the granularity of
    FA3's q/k/v_descale. Power-of-two scales keep the scaling exact. groups: Hk for a GQA / MQA Q, whose
    descale FA3 takes per (batch, K/V head) ([B, Hk]): one amax over each group of H / Hk query heads."""
    import torch
    b, s, h, d = x.shape
    g = h if groups is None else groups
    amax = x.abs().reshape(b, s, g, h // g, d).amax(dim=(1, 3, 4)).float().clamp_min(1e-12)   # [B, G]
    mult = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    per_head = mult.repeat_interleave(h // g, dim=1)                                        # [B, H]
    codes = (x.float() * per_head[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, mult.reciprocal().contiguous()


def build_fa3(inp, scope, fp8):
    mod, _ = _fa3()
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    if not fp8:
        return Built(lambda: mod.flash_attn_func(q, k, v, softmax_scale=scale, causal=False), _first_out)

    def quantized():
        return [quantize_per_head(x) for x in (q, k, v)]

    def call(qkv):
        (q8, dq), (k8, dk), (v8, dv) = qkv
        return mod.flash_attn_func(q8, k8, v8, softmax_scale=scale, causal=False,
                                   q_descale=dq, k_descale=dk, v_descale=dv)
    params = {"quantization": "per (batch, head) amax, power-of-two scale"}
    if scope == "attention":
        prepared = quantized()
        return Built(lambda: call(prepared), _first_out, params=params)
    return Built(lambda: call(quantized()), _first_out, params=params)


def build_fa4(inp, scope):
    mod, _ = _fa4()
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    return Built(lambda: mod.flash_attn_func(q, k, v, softmax_scale=scale, causal=False), _first_out)


def sage2_function():
    """sageattention.sageattn (thu-ml/SageAttention, built as shared/tools/sage2-anchor.md says)."""
    mod, _ = _import_first(["sageattention"], "sageattn")
    return mod.sageattn


def build_sage2(inp, scope, causal=False):
    """SageAttention2: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal) on the BF16 [B, S, H, D]
    inputs; on sm90 it runs sageattn_qk_int8_pv_fp8_cuda_sm90. Timed eagerly (Built.eager)."""
    sageattn = sage2_function()
    q, k, v, scale = inp.q, inp.k, inp.v, inp.softmax_scale
    kwargs = {} if scale is None else {"sm_scale": scale}
    params = {"call": f"sageattn(q, k, v, tensor_layout='NHD', is_causal={bool(causal)})",
              "timing": "eager (its launches do not replay from a CUDA graph)"}
    return Built(lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal, **kwargs), _first_out,
                 params=params, eager=True)


def _quantize_tensor(x):
    """Per-tensor e4m3 codes and a [1,1,1,1] float32 descale (power-of-two scale)."""
    import torch
    amax = x.abs().amax().float().clamp_min(1e-12)
    mult = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (x.float() * mult).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), mult.reciprocal().reshape(1, 1, 1, 1)


def build_cudnn_fp8(inp, scope):
    """cuDNN FP8 SDPA through the cudnn frontend's Python graph API. Hopper produces FP8 O (scale_o
    applied); the complete scope includes quantization and the dequantization to BF16."""
    import torch
    cudnn, _ = _import_first(["cudnn"], "pygraph")
    q, k, v = inp.q, inp.k, inp.v
    b, s, h, d = q.shape
    scale = inp.softmax_scale if inp.softmax_scale is not None else 1.0 / math.sqrt(d)
    handle = cudnn.create_handle()
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    dims, strides = (b, h, s, d), (s * h * d, d, h * d, 1)   # [B,H,S,D] dims over [B,S,H,D] memory
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
    scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)
    tdq, tdk, tdv, tds, tss, tso = (graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so"))
    kwargs = dict(q=tq, k=tk, v=tv, descale_q=tdq, descale_k=tdk, descale_v=tdv, descale_s=tds,
                  scale_s=tss, scale_o=tso, attn_scale=scale, use_causal_mask=False, name="sdpa_fp8")
    try:
        o, _, amax_s, amax_o = graph.sdpa_fp8(generate_stats=False, **kwargs)
    except TypeError:   # older frontends spell it is_inference
        o, _, amax_s, amax_o = graph.sdpa_fp8(is_inference=True, **kwargs)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    dev = q.device
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=dev)
    s_scale = torch.full((1, 1, 1, 1), 256.0, dtype=torch.float32, device=dev)   # P <= 1 -> codes <= 256
    s_descale = s_scale.reciprocal()
    amax_bufs = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev) for _ in range(2)]
    out8 = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=dev)

    def run(qkv):
        (q8, dq), (k8, dk), (v8, dv) = qkv
        o_scale = dv.reciprocal() * 0.5    # |O| <= max|V|: half the V scale leaves headroom
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(dev).cuda_stream)
        graph.execute({tq: q8, tk: k8, tv: v8, tdq: dq, tdk: dk, tdv: dv, tds: s_descale, tss: s_scale,
                       tso: o_scale, o: out8, amax_s: amax_bufs[0], amax_o: amax_bufs[1]}, workspace, handle=handle)
        return out8, o_scale

    def dequant(res):
        o8, o_scale = res
        return (o8.float() / o_scale).to(torch.bfloat16)
    params = {"quantization": "per-tensor amax, power-of-two scale; softmax scale 256; FP8 output"}
    if scope == "attention":
        prepared = [_quantize_tensor(x) for x in (q, k, v)]
        built = Built(lambda: run(prepared), dequant, note="times FP8 output (no BF16 conversion)", params=params)
    else:
        built = Built(lambda: dequant(run([_quantize_tensor(x) for x in (q, k, v)])), params=params)
    built.keep = (graph, handle, workspace)   # keeps the plan alive as long as the closure
    return built


def build(name, inp, scope, *, repair_budget=None,
          mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS) -> Built:
    if name == "open-vc":
        return build_open_vc(inp, scope, mid_window_blocks)
    if name == "open-vc-repair":
        return build_open_vc_repair(inp, scope, repair_budget, mid_window_blocks)
    if name == "vc":
        return build_vc(inp, scope)
    if name in ("sdpa-cudnn", "sdpa-flash"):
        return build_sdpa(inp, scope, name)
    if name in ("fa3-bf16", "fa3-fp8"):
        return build_fa3(inp, scope, fp8=name == "fa3-fp8")
    if name == "fa4-bf16":
        return build_fa4(inp, scope)
    if name == "cudnn-fp8":
        return build_cudnn_fp8(inp, scope)
    if name == "sage2":
        return build_sage2(inp, scope)
    raise Missing(f"unknown backend {name!r}")


# ---- ceilings -------------------------------------------------------------------------------------------

GEMM_N = 8192
COPY_BYTES = 1 << 30


def ceiling_builders(device):
    """name -> (builder() -> fn, work): work is FLOPs for the GEMMs and bytes moved (read + write) for
    the copy. Inputs are built lazily, so a failing one does not stop the others."""
    import torch
    n = GEMM_N

    def gemm_bf16():
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        return lambda: torch.matmul(a, b)

    def gemm_fp8():
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()   # column-major, as cuBLASLt wants
        one = torch.ones((), device=device, dtype=torch.float32)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def copy():
        # An elementwise kernel on the SMs: Tensor.copy_ between device buffers runs on the copy
        # engines, measured at about 2.6 TB/s on the H200, well under what the SMs move.
        src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        return lambda: torch.neg(src, out=dst)
    return {"gemm_fp8": (gemm_fp8, 2 * n ** 3), "gemm_bf16": (gemm_bf16, 2 * n ** 3),
            "copy": (copy, 2 * COPY_BYTES)}
