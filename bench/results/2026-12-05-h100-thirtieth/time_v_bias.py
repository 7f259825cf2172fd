"""Thirtieth session: what the V bias correction costs now that it is its own kernel mode (INT8 Q/K only). For each
shape and INT8 format, the complete call with and without v_bias_correction: CUDA graphs of R calls, 7 interleaved
rounds, the per-round ratio (corrected / plain time) and its median; then the per-kernel device times of one form
(torch.profiler, 20 calls). One JSON line per shape, then the profile lines."""
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

import open_vc_attn as ova

SHAPES = [(4096, 7), (8192, 40), (32760, 40), (73397, 7)]
MODES = {"int8+smooth": dict(qk_format="int8", k_smoothing=True),
         "int8+smooth+exp2": dict(qk_format="int8", k_smoothing=True, p_format="exp2")}
ROUNDS = 7


def graph_ms(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def kernel_us(q, k, v, kw, calls=20):
    for _ in range(3):
        ova.attention(q, k, v, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            ova.attention(q, k, v, **kw)
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name.replace("void ", "").replace("openvc::", "").split("(")[0]
            tot[n[:70]] += e.device_time_total
    return {n: round(t / calls, 1) for n, t in sorted(tot.items(), key=lambda x: -x[1])}


def main():
    profiles = []
    for s, h in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, s, h, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
        flops = 4 * h * s * s * 128
        reps = max(3, int(2e-2 / (flops / 1.0e15)))
        variants = {f"{m}{'+vbias' if vb else ''}": dict(kw, v_bias_correction=vb)
                    for m, kw in MODES.items() for vb in (False, True)}
        times = {n: [] for n in variants}
        for _ in range(ROUNDS):
            for n, kw in variants.items():
                times[n].append(graph_ms(lambda kw=kw: ova.attention(q, k, v, **kw), reps))
        med = {n: sorted(t)[ROUNDS // 2] for n, t in times.items()}
        ratios = {m: sorted(a / b for a, b in zip(times[m + "+vbias"], times[m]))[ROUNDS // 2] for m in MODES}
        print(json.dumps({"shape": [1, s, h], "median_ms": med, "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in
                                                                          med.items()},
                          "vbias_over_plain_paired": ratios}), flush=True)
        if s <= 32760:
            for n in ("int8+smooth+exp2", "int8+smooth+exp2+vbias"):
                profiles.append(f"S={s} H={h} {n}: {kernel_us(q, k, v, variants[n])}")
    for line in profiles:
        print(line, flush=True)


if __name__ == "__main__":
    main()
