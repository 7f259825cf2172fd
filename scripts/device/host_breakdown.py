"""Host time of each step of one eager open_vc_attn.attention call (Sq = Sk = 256, H = 12), on the GPU machine."""
import time, json, os, sys
import torch
import open_vc_attn as ova
from open_vc_attn import _ext, _checks, api
from open_vc_attn.ops import fp8, device as dev, direct

def t(name, f, n=400, res={}):
    for _ in range(20): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): f()
    el = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    res[name] = round(el, 2); print(f"{name:44s} {el:8.2f} us", flush=True)
    return res

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 256, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
ext = _ext.load()
res = {}
t("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), res=res)
t("ova.attention", lambda: ova.attention(q, k, v), res=res)
t("direct.prepare_fp8", lambda: direct.prepare_fp8(q, k, v), res=res)
t("fp8.prepare_cuda(checked)", lambda: fp8.prepare_cuda(q, k, v, checked=True), res=res)
t("check_rank4_tokens", lambda: _checks.check_rank4_tokens("prepare_fp8", q, k, v), res=res)
t("launch_checks", lambda: dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v))), res=res)
t("check_device", lambda: dev.check_device(q.device), res=res)
alloc = dev.empty(q.device)
t("_prepare_outputs (6 empty)", lambda: fp8._prepare_outputs(q, k, alloc), res=res)
t("torch.empty cuda x1", lambda: torch.empty((1, 256, 12, 128), dtype=torch.uint8, device=q.device), res=res)
outs = fp8._prepare_outputs(q, k, alloc)
t("launch_prepare", lambda: fp8.launch_prepare(q, k, v, outs, None), res=res)
p = dev.params(ext.PrepareParams, dtype=dev.dtype_of(q), heads=12, head_dim=128, q=dev.token_view(q),
               k=dev.token_view(k), v=dev.token_view(v), **dict(zip(fp8.FP8_NAMES, (x.data_ptr() for x in outs))))
p.batch, p.seqlen_q, p.seqlen_k = 1, 256, 256
ws = dev.workspace(ext.prepare_workspace_bytes(1, 12, 256, False), q.device)
p.workspace, p.workspace_bytes = ws.data_ptr(), ws.numel()
t("ext.prepare_fp8 (C++ + 3 launches)", lambda: ext.prepare_fp8(p, torch.cuda.current_stream().cuda_stream), res=res)
t("enqueue(ext.prepare_fp8)", lambda: dev.enqueue(ext.prepare_fp8, p, q.device), res=res)
t("direct.attention_fp8", lambda: direct.attention_fp8(outs, 0.088, 4, False), res=res)
t("fp8.attention_cuda(checked)", lambda: fp8.attention_cuda(outs, 0.088, 4, False, checked=True), res=res)
sizes = fp8._batched_sizes(outs)
out, lse = fp8.attention_outputs(outs[0], False, alloc, None)
ap = fp8.fast_params(outs, sizes, out, None, 0.088, 4)
t("fast_params", lambda: fp8.fast_params(outs, sizes, out, None, 0.088, 4), res=res)
t("attention_outputs", lambda: fp8.attention_outputs(outs[0], False, alloc, None), res=res)
t("ext.attention_fp8 (C++ + launch)", lambda: ext.attention_fp8(ap, torch.cuda.current_stream().cuda_stream), res=res)
t("cuda launch-only: torch.add_", lambda: q.add_(0), res=res)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_breakdown.json"), "w"), indent=1)
