"""Per-kernel device times (torch.profiler, CUDA activity) of the complete call with and without v_bias_correction,
E4M3 and INT8 + K smoothing: where the corrected call's extra time goes. Prints kernel name, mean us per call."""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import open_vc_attn as ova

CALLS = 20
for s, h in ((4096, 7), (32760, 40)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    for name, kw in (("e4m3", {}), ("int8+smooth", dict(qk_format="int8", k_smoothing=True))):
        for vb in (False, True, False, True):
            for _ in range(3):
                ova.attention(q, k, v, v_bias_correction=vb, **kw)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    ova.attention(q, k, v, v_bias_correction=vb, **kw)
                torch.cuda.synchronize()
            tot = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    n = e.name.replace("void ", "").replace("openvc::", "").split("(")[0]
                    tot[n[:70]] += e.device_time_total
            parts = ", ".join(f"{k_} {v_ / CALLS:.1f}" for k_, v_ in sorted(tot.items(), key=lambda x: -x[1]))
            print(f"S={s} H={h} {name}{'+vbias' if vb else ''}: total {sum(tot.values()) / CALLS:.1f} us | {parts}",
                  flush=True)
