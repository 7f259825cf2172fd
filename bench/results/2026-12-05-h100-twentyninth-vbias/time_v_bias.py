"""Twenty-ninth session: the complete call's time with and without v_bias_correction (CUDA graphs of R calls, 5
interleaved rounds, medians), and the default call's time for the A/B of two libraries (run once per library:
--only-default). Prints one JSON line per shape."""
import json
import sys

import torch

import open_vc_attn as ova

SHAPES = [(1, 4096, 7), (1, 8192, 40), (1, 32760, 40), (1, 73397, 7)]
MODES = {"e4m3": {}, "int8+smooth": dict(qk_format="int8", k_smoothing=True),
         "int8+smooth+exp2": dict(qk_format="int8", k_smoothing=True, p_format="exp2")}


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


def main():
    only_default = "--only-default" in sys.argv
    for b, s, h in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
        flops = 4 * b * h * s * s * 128
        reps = max(3, int(2e-2 / (flops / 1.0e15)))
        variants = {"e4m3": {}} if only_default else {
            f"{m}{'+vbias' if vb else ''}": dict(kw, v_bias_correction=vb) for m, kw in MODES.items() for vb in (False, True)}
        times = {n: [] for n in variants}
        for _ in range(5):
            for n, kw in variants.items():
                times[n].append(graph_ms(lambda: ova.attention(q, k, v, **kw), reps))
        med = {n: sorted(t)[2] for n, t in times.items()}
        rec = {"shape": [b, s, h], "median_ms": med, "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in med.items()}}
        if not only_default:
            rec["vbias_over_plain"] = {m: med[m + "+vbias"] / med[m] for m in MODES}
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
