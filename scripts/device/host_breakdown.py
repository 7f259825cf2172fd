"""Host time of each step of one eager open_vc_attn.attention call (Sq = Sk = 256, H = 12), on the GPU machine:
the one op's implementation (open_vc_attn.ops.call) piece by piece, against torch SDPA."""
import json
import os
import time

import torch

import open_vc_attn as ova
from open_vc_attn import _ext
from open_vc_attn.ops import call, device as dev
from open_vc_attn.ops.fp8 import sequence_outputs


def t(name, f, n=400, res={}):
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    el = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    res[name] = round(el, 2)
    print(f"{name:44s} {el:8.2f} us", flush=True)
    return res


g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 256, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
ext = _ext.load()
res = {}
args = (q, k, v, None, None, 0, 0, None, 0.0, False, 4, False, None, "e4m3", False, "expcast")
t("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2)), res=res)
t("ova.attention", lambda: ova.attention(q, k, v), res=res)
t("ops.call.attention_cuda", lambda: call.attention_cuda(*args), res=res)
t("call._check", lambda: call._check(q, k, v, None, None, 0, 0, None, "e4m3", False, "expcast"), res=res)
t("launch_checks", lambda: dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v))), res=res)
alloc, fill = dev.empty(q.device), dev.full(q.device)
t("sequence_outputs (out, empty lse)", lambda: sequence_outputs(False, call._sizes(q, False), False, alloc, fill, None),
  res=res)
out, _ = sequence_outputs(False, call._sizes(q, False), False, alloc, fill, None)
mk = lambda: call._call_struct(q, k, v, None, None, 0, 0, None, 0.0, False, 4, out, None, "e4m3", False, "expcast")
t("_call_struct", mk, res=res)
c = mk()
t("attention_workspace_bytes", lambda: ext.attention_workspace_bytes(c), res=res)
nbytes = ext.attention_workspace_bytes(c)
t("workspace torch.empty", lambda: dev.workspace(nbytes, q.device), res=res)
ws = dev.workspace(nbytes, q.device)
stream = torch.cuda.current_stream().cuda_stream
t("ext.attention (C++ + launches)", lambda: ext.attention(c, ws.data_ptr(), ws.numel(), stream), res=res)
t("cuda launch-only: torch.add_", lambda: q.add_(0), res=res)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_breakdown.json"), "w"), indent=1)
