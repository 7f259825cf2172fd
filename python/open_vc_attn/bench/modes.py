"""open-vc-attn-bench-modes: the fast path's call forms against the peers, in one process.

Cases (issue 15's acceptance shapes): dense D = 128 at S = 73,397; packed sequences totalling 73,397
tokens (against the dense call of the same total, same run); HunyuanVideo-like joint attention with
text padding (key padding mask and key counts; FLOPs counted on the valid tokens); causal (FLOPs
counted as half); head dim 64. Peers where importable: FlashAttention-3 BF16 and FP8 (flash_attn_interface
on PYTHONPATH, built as shared/tools/fa3-anchor.md says; FP8 on inputs pre-cast per (batch, head)) and
cuDNN BF16 through torch SDPA. Every entry of a case is timed as the product benchmark does (harness.Timer:
CUDA graphs of R calls >= 20 ms), in rounds whose entry order is shuffled; ratios are paired per round.

    python -m open_vc_attn.bench.modes --cases dense,packed,padded,causal,d64 --rounds 5 --out modes.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

from . import harness

CASES = ("dense", "packed", "padded", "causal", "d64")


def _fa3():
    try:
        import flash_attn_interface as fa3
        return fa3
    except ImportError:
        return None


def _qkv(torch, b, s, h, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _sdpa(torch, q, k, v, causal=False, mask=None):
    """cuDNN BF16 attention through torch SDPA on [B, H, S, D]-contiguous copies (made once)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal)
    return call


def _fa3_entries(torch, q, k, v, causal):
    fa3 = _fa3()
    if fa3 is None:
        return {}
    from .backends import quantize_per_head
    (q8, dq), (k8, dk), (v8, dv) = (quantize_per_head(x) for x in (q, k, v))
    return {"fa3-bf16": lambda: fa3.flash_attn_func(q, k, v, causal=causal),
            "fa3-fp8": lambda: fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk,
                                                  v_descale=dv)}


def _dense_entries(torch, ova, b, s, h, d=128, causal=False, seed=0):
    q, k, v = _qkv(torch, b, s, h, d, seed)
    prepared = ova.prepare_fp8(q, k, v)
    entries = {"openvc": lambda: ova.attention(q, k, v, causal=causal),
               "openvc-kernel": lambda: ova.attention_fp8(prepared, causal=causal),
               "cudnn-bf16": _sdpa(torch, q, k, v, causal=causal)}
    entries.update(_fa3_entries(torch, q, k, v, causal))
    flops = harness.attention_flops(b, h, s, s, d) * (0.5 if causal else 1.0)
    return entries, {e: flops for e in entries}


def case_list(names):
    out = []
    for name in names:
        if name == "dense":
            out += [("dense-S73397-H%d" % h, dict(kind="dense", s=73397, h=h)) for h in (7, 14, 56)]
        elif name == "packed":
            for h in (7, 56):
                out.append(("packed-2x36698-H%d" % h, dict(kind="packed", lens=(36698, 36699), h=h)))
                out.append(("packed-3uneven-H%d" % h, dict(kind="packed", lens=(40000, 25000, 8397), h=h)))
        elif name == "padded":
            out.append(("padded-hunyuan-H24", dict(kind="padded", video=118800, text=256, pad=200, h=24)))
        elif name == "causal":
            out += [("causal-S32768-H7", dict(kind="dense", s=32768, h=7, causal=True)),
                    ("causal-S75600-H40", dict(kind="dense", s=75600, h=40, causal=True))]
        elif name == "d64":
            out += [("d64-S24576-H32", dict(kind="dense", s=24576, h=32, d=64)),
                    ("d64-S32760-H24", dict(kind="dense", s=32760, h=24, d=64))]
        else:
            raise ValueError(f"--cases: expected names from {CASES}, got {name!r}")
    return out


def build_case(torch, ova, spec):
    kind = spec["kind"]
    if kind == "dense":
        return _dense_entries(torch, ova, 1, spec["s"], spec["h"], spec.get("d", 128), spec.get("causal", False))
    if kind == "packed":
        lens, h, d = spec["lens"], spec["h"], 128
        total = sum(lens)
        q, k, v = (x[0] for x in _qkv(torch, 1, total, h, d, 1))
        cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device="cuda")
        prepared = ova.prepare_fp8(q, k, v, cu, cu, max(lens), max(lens))
        dense = ova.prepare_fp8(q[None], k[None], v[None])
        entries = {"openvc-packed": lambda: ova.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                          max_seqlen_q=max(lens), max_seqlen_k=max(lens)),
                   "openvc-packed-kernel": lambda: ova.attention_fp8(prepared),
                   "openvc-dense-kernel": lambda: ova.attention_fp8(dense)}
        packed_flops = sum(harness.attention_flops(1, h, n, n, d) for n in lens)
        flops = {"openvc-packed": packed_flops, "openvc-packed-kernel": packed_flops,
                 "openvc-dense-kernel": harness.attention_flops(1, h, total, total, d)}
        if max(lens) - min(lens) <= 1:
            # The same tiles without the varlen mode: B = len(lens) batched sequences of the shortest length,
            # which separates the cost of shorter tiles from the cost of reading lengths on the device.
            n = min(lens)
            batched = ova.prepare_fp8(*(x[:len(lens) * n].reshape(len(lens), n, h, d) for x in (q, k, v)))
            entries["openvc-batched-kernel"] = lambda: ova.attention_fp8(batched)
            flops["openvc-batched-kernel"] = harness.attention_flops(len(lens), h, n, n, d)
        return entries, flops
    if kind == "padded":
        s, h, d = spec["video"] + spec["text"], spec["h"], 128
        valid = s - spec["pad"]
        q, k, v = _qkv(torch, 1, s, h, d, 2)
        keep = torch.ones(1, s, dtype=torch.bool, device="cuda")
        keep[:, valid:] = False   # the text padding at the end of the joint sequence
        counts = torch.tensor([valid], dtype=torch.int32, device="cuda")
        prepared = ova.prepare_fp8(q, k, v, seqused_k=counts)
        entries = {"openvc-mask": lambda: ova.attention(q, k, v, key_padding_mask=keep),
                   "openvc-seqused": lambda: ova.attention(q, k, v, seqused_k=counts),
                   "openvc-kernel": lambda: ova.attention_fp8(prepared),
                   "cudnn-bf16-mask": _sdpa(torch, q, k, v, mask=keep[:, None, None, :])}
        flops = harness.attention_flops(1, h, valid, valid, d)   # counted on the valid tokens
        return entries, {e: flops for e in entries}
    raise ValueError(kind)


def run(case_names, rounds, seed=0):
    import torch
    import open_vc_attn as ova
    records = []
    for name, spec in case_list(case_names):
        t0 = time.time()
        entries, flops = build_case(torch, ova, spec)
        timers, errors = {}, {}
        for e, fn in entries.items():
            try:
                timers[e] = harness.Timer(fn)
            except Exception as exc:   # a peer that cannot run this case: recorded, not fatal
                errors[e] = f"{type(exc).__name__}: {exc}"[:300]
        samples = {e: [] for e in timers}
        for order in harness.visiting_orders(sorted(timers), rounds, seed):
            for e in order:
                samples[e].append(timers[e].sample())
        for t in timers.values():
            t.release()
        res = {e: {"median_ms": harness.median(v), "tflops": harness.tflops(flops[e], harness.median(v)),
                   "samples_ms": v, "method": timers[e].method} for e, v in samples.items()}
        base = "openvc" if "openvc" in res else next(iter(res))
        ratios = {f"{base}_vs_{e}": harness.paired_ratios(samples[e], samples[base])["median"]
                  for e in res if e != base}
        if "openvc-packed-kernel" in res:
            # TFLOP/s of the packed kernel over the dense kernel's on the same total (the acceptance ratio).
            ratios["packed_tflops_over_dense"] = res["openvc-packed-kernel"]["tflops"] / res["openvc-dense-kernel"]["tflops"]
        records.append({"case": name, "spec": spec, "results": res, "ratios": ratios, "errors": errors,
                        "seconds": round(time.time() - t0, 1)})
        line = " | ".join(f"{e} {r['tflops']:.0f} TF" for e, r in res.items())
        print(f"{name}: {line}", flush=True)
        print("    " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if not math.isnan(v)) +
              (f"  errors: {errors}" if errors else ""), flush=True)
        del entries, timers
        torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="open-vc-attn-bench-modes", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    p.add_argument("--out", help="write the records as JSON here")
    args = p.parse_args(argv)
    import torch
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "fa3": _fa3() is not None}
    records = run(args.cases.split(","), args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
