"""openvc in a diffusers video transformer: a randomly initialized Wan (WanTransformer3DModel) run with
diffusers' native attention (torch SDPA, BF16) and with openvc, at a long video sequence.

    python examples/diffusers_wan.py                       # Wan 480p latent: 21 x 60 x 104 -> 32,760 tokens
    python examples/diffusers_wan.py --frames 11 --json out.json

Prints the relative L2 difference of the transformer outputs, the time of one forward with each backend,
and which attention calls took openvc (self-attention) and which stayed on SDPA (text cross-attention:
512 keys). Exit status 1 when the difference exceeds --max-rel-l2 (or, with --require-speedup, when openvc
is not faster). Needs torch, diffusers and, for openvc, a Hopper GPU.

With a real pipeline the integration is two lines (docs/integrations/diffusers.md):

    from open_vc_attn.integrations import diffusers as openvc_diffusers
    openvc_diffusers.apply(pipe.transformer)     # pipe = diffusers.WanPipeline.from_pretrained(...)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build_model(*, heads=12, layers=2, head_dim=128, ffn_dim=8960, text_dim=4096, sharpen=3.0, seed=0,
                device="cuda", dtype=None):
    """A WanTransformer3DModel with random weights (Wan2.1-1.3B widths by default: 12 heads of 128, FFN
    8960, 4096-wide text), in BF16. sharpen scales the self-attention q/k RMSNorm weights: random weights
    give nearly uniform attention, where any attention error averages out; trained video models attend
    much more sharply, which sharpen (logits x sharpen^2) imitates."""
    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()   # .to(bfloat16) warns about modules kept in FP32 by from_pretrained
    torch.manual_seed(seed)
    model = WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                                  out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn_dim,
                                  num_layers=layers, rope_max_seq_len=1024)
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.norm_q.weight.mul_(sharpen)
            block.attn1.norm_k.weight.mul_(sharpen)
    return model.to(device=device, dtype=dtype or torch.bfloat16).eval()


def make_inputs(*, frames=21, height=60, width=104, text_tokens=512, text_dim=4096, seed=1, device="cuda",
                dtype=None):
    """Latent video [1, 16, frames, height, width] (tokens: frames * height/2 * width/2), timestep, text
    states [1, text_tokens, text_dim]."""
    import torch
    dtype = dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, frames, height, width, generator=gen).to(device, dtype)
    text = torch.randn(1, text_tokens, text_dim, generator=gen).to(device, dtype)
    return {"hidden_states": latents, "timestep": torch.tensor([500], device=device), "encoder_hidden_states": text}


def forward(model, inputs):
    import torch
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


def time_forward(model, inputs, *, iters=5, warmup=2):
    """Median milliseconds of one forward: on a GPU timed as the benchmark times it
    (open_vc_attn.bench.harness, which warms up itself), on the CPU by the wall clock."""
    if inputs["hidden_states"].is_cuda:
        from open_vc_attn.bench import harness
        return harness.median_ms(lambda: forward(model, inputs), rounds=iters)
    for _ in range(warmup):
        forward(model, inputs)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        forward(model, inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(model, inputs, *, iters=5, warmup=2, policy=None, timed=True):
    """Runs ``model`` with its own attention, then with openvc applied (and removed again). Returns a dict
    with rel_l2 (openvc vs native output), cosine, both times, the speedup and the routing counts."""
    import torch
    from open_vc_attn.integrations import diffusers as ovd

    ref = forward(model, inputs)
    t_native = time_forward(model, inputs, iters=iters, warmup=warmup) if timed else None
    ovd.apply(model, policy=policy)
    try:
        ovd.reset_stats()
        out = forward(model, inputs)
        routes = {f"{path}{': ' + why if why else ''}": n for (path, why), n in ovd.stats().items()}
        t_openvc = time_forward(model, inputs, iters=iters, warmup=warmup) if timed else None
    finally:
        ovd.remove(model)
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))
    res = {"tokens": int(inputs["hidden_states"][0, 0].numel() // 4), "rel_l2": rel_l2(out, ref), "cosine": cos,
           "routes": routes, "ms_native": t_native, "ms_openvc": t_openvc}
    if timed:
        res["speedup"] = t_native / t_openvc
    return res, out, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=21, help="latent frames (Wan 480p, 81 frames: 21)")
    ap.add_argument("--height", type=int, default=60, help="latent height (480 / 8)")
    ap.add_argument("--width", type=int, default=104, help="latent width (832 / 8)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sharpen", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-rel-l2", type=float, default=0.03)
    ap.add_argument("--require-speedup", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)

    model = build_model(heads=args.heads, layers=args.layers, sharpen=args.sharpen, device=args.device)
    inputs = make_inputs(frames=args.frames, height=args.height, width=args.width, device=args.device)
    res, _, _ = compare(model, inputs, iters=args.iters)
    res.update(vars(args))
    print(f"Wan (random, {args.layers} layers, {args.heads}x128 heads), {res['tokens']} video tokens: "
          f"rel L2 {res['rel_l2']:.3%} (cosine {res['cosine']:.6f}), native {res['ms_native']:.1f} ms, "
          f"openvc {res['ms_openvc']:.1f} ms, speedup {res['speedup']:.2f}x")
    print(f"routes: {res['routes']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = res["rel_l2"] <= args.max_rel_l2 and (not args.require_speedup or res["speedup"] > 1.0)
    if not ok:
        print(f"FAIL: rel L2 bound {args.max_rel_l2:.3%}{' / speedup > 1' if args.require_speedup else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
