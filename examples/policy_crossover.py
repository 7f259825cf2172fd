"""Where openvc starts to pay on this GPU: the numbers behind the integrations' DispatchPolicy thresholds.

    python examples/policy_crossover.py [--heads 12] [--json out.json]

Times open_vc_attn.attention (quantization included, as the integrations call it) against torch's
scaled_dot_product_attention in BF16 (what diffusers' "native" backend and SGLang's SDPA backend run), for
self-attention at growing sequence lengths and for cross-attention of a 32,760-token video to a growing
number of keys. Prints the speedup per size and the smallest self-attention length and key count from
which openvc is faster. The default policy (open_vc_attn.integrations.policy.DEFAULT_POLICY) uses the crossover that
scripts/device/dispatch_floor.py measured over the whole (Sq, Sk) grid at 12, 24 and 40 heads
(policy.CROSSOVER_RECORD: 4,096 query tokens, 4,096 keys); pass other thresholds with
DispatchPolicy(min_query_tokens=..., min_key_tokens=...).
"""
from __future__ import annotations

import argparse
import json
import sys


def bench(fn, iters=20):
    """Milliseconds per call of back-to-back eager calls (open_vc_attn.bench.harness, no CUDA graph): the
    integrations' frameworks call attention eagerly, so the per-call host time belongs in the crossover
    (a graph would hide it)."""
    from open_vc_attn.bench import harness
    return harness.median_ms(fn, rounds=iters, use_graph=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--self-lengths", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--cross-keys", default="257,512,1024,2048,4096")
    ap.add_argument("--video-tokens", type=int, default=32760)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch
    import open_vc_attn

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def rand(s):
        return torch.randn(1, s, args.heads, 128, device="cuda", dtype=torch.bfloat16)

    rows = []
    cases = [("self", s, s) for s in map(int, args.self_lengths.split(","))]
    cases += [("cross", args.video_tokens, s) for s in map(int, args.cross_keys.split(","))]
    with torch.inference_mode():
        for kind, sq, sk in cases:
            q, k, v = rand(sq), rand(sk), rand(sk)
            t_ovc = bench(lambda: open_vc_attn.attention(q, k, v))
            t_sdpa = bench(lambda: sdpa(q, k, v))
            rows.append({"kind": kind, "sq": sq, "sk": sk, "ms_openvc": t_ovc, "ms_sdpa": t_sdpa,
                         "speedup": t_sdpa / t_ovc})
            print(f"{kind:5s} Sq={sq:6d} Sk={sk:6d}: openvc {t_ovc:8.3f} ms  sdpa {t_sdpa:8.3f} ms  "
                  f"{t_sdpa / t_ovc:5.2f}x")

    def first_win(kind, key):
        wins = [r[key] for r in rows if r["kind"] == kind and r["speedup"] > 1.0]
        return min(wins) if wins else None
    summary = {"self_from_tokens": first_win("self", "sq"), "cross_from_keys": first_win("cross", "sk")}
    print(f"openvc faster from: self-attention {summary['self_from_tokens']} tokens, cross-attention "
          f"{summary['cross_from_keys']} keys (of {args.video_tokens} queries)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "heads": args.heads}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
