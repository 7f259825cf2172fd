#!/usr/bin/env python3
"""Block-sparse attention (issue 26): openvc with key block lists against FlexAttention, same process.

    python3 scripts/device/block_sparse_bench.py [--frames 21] [--tokens-per-frame 3600] [--heads 40]
        [--rounds 5] [--masks dense,frame_causal,window2,radial] [--out OUT.json]

B = 1, D = 128, BF16 [B, S, H, D] inputs (S = frames * tokens_per_frame; 21 x 3,600 = 75,600 is Wan 720p's
token count). For each mask of open_vc_attn.masks (FlexAttention BlockMasks at 128-token blocks):
- openvc: open_vc_attn.attention(q, k, v, block_mask=mask), the complete call (preparation included), eager;
  and the dense call (no mask) as the baseline;
- FlexAttention: torch.compile(flex_attention) on the same BlockMask (its mask_mod evaluated in partial
  blocks: the element-level mask FlexAttention users run), and dense (no block mask).
Timing: CUDA events around each call after warm-up; every backend once per round in a fixed interleaved
order; medians over rounds; ratios are medians of per-round ratios (paired). TF/s counts the FLOPs of the
visited blocks (4 * 128 * 128 * D per listed block per head), the work both kernels do.
Accuracy: openvc's output against FlexAttention's with the BLOCK-level mask (a mask_mod that keeps exactly the
listed blocks, so both compute the same attention): rel L2 (FP8 quantization, a few percent).
Writes OUT.json (default $OUT/block_sparse.json) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--tokens-per-frame", type=int, default=3600)
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--masks", default="dense,frame_causal,window2,radial")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "block_sparse.json"))
    return p.parse_args(argv)


def make_mask(masks, name, frames, tpf, device):
    if name == "dense":
        return None
    if name == "frame_causal":
        return masks.frame_causal(frames, tpf, device=device)
    if name.startswith("window"):
        return masks.temporal_window(frames, tpf, int(name[len("window"):]), device=device)
    if name == "radial":
        return masks.radial(frames, tpf, device=device)
    raise ValueError(f"--masks: unknown mask {name!r}")


def block_level_mask(torch, flex, block_mask, seqlen):
    """A BlockMask whose mask_mod keeps exactly the listed 128 x 128 blocks (what openvc computes)."""
    dense = block_mask.to_dense()[0, 0].to(torch.bool)   # [q_tiles, k_tiles]: partial or full blocks

    def mod(b, h, q_idx, kv_idx):
        return dense[q_idx // 128, kv_idx // 128]

    return flex.create_block_mask(mod, 1, 1, seqlen, seqlen, device=dense.device, BLOCK_SIZE=128)


def timed(torch, fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.attention.flex_attention as flex

    import open_vc_attn
    from open_vc_attn import masks

    dev = torch.device("cuda")
    S, H, D = args.frames * args.tokens_per_frame, args.heads, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))   # FlexAttention's [B, H, S, D] views
    flex_attn = torch.compile(flex.flex_attention, dynamic=False)
    names = [m for m in args.masks.split(",") if m]
    cases, fns = {}, {}
    for name in names:
        bm = make_mask(masks, name, args.frames, args.tokens_per_frame, dev)
        if bm is None:
            listed = (-(-S // 128)) ** 2
            fns[("openvc", name)] = lambda: open_vc_attn.attention(q, k, v)
            fns[("flex", name)] = lambda: flex_attn(qt, kt, vt)
        else:
            counts, _ = masks.block_lists(bm)
            listed = int(counts.sum().item())
            fns[("openvc", name)] = lambda bm=bm: open_vc_attn.attention(q, k, v, block_mask=bm)
            fns[("flex", name)] = lambda bm=bm: flex_attn(qt, kt, vt, block_mask=bm)
            ref = flex_attn(qt, kt, vt, block_mask=block_level_mask(torch, flex, bm, S)).transpose(1, 2)
            got = open_vc_attn.attention(q, k, v, block_mask=bm)
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        cases[name] = {"listed_blocks_per_head": listed, "fraction": listed / (-(-S // 128)) ** 2,
                       "flops": 4.0 * 128 * 128 * D * listed * H}
        if bm is not None:
            cases[name]["rel_l2_vs_flex_block_level"] = rel
    for fn in fns.values():   # warm-up and compile
        fn()
    torch.cuda.synchronize()
    times = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, fn in fns.items():
            times[key].append(timed(torch, fn, 3))
    dense_openvc = times.get(("openvc", "dense"))
    rows = []
    for name in names:
        c = cases[name]
        o, f = times[("openvc", name)], times[("flex", name)]
        c.update(openvc_ms=statistics.median(o), flex_ms=statistics.median(f),
                 openvc_tflops=c["flops"] / statistics.median(o) / 1e9,
                 vs_flex=statistics.median(b / a for a, b in zip(o, f)))
        if dense_openvc:
            c["vs_openvc_dense"] = statistics.median(d / a for a, d in zip(o, dense_openvc))
        rows.append((name, c))
    print(f"S = {S} ({args.frames} x {args.tokens_per_frame}), H = {H}, D = {D}, BF16, {args.rounds} rounds, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'mask':>14} {'blocks':>7} {'openvc ms':>10} {'TF/s':>6} {'flex ms':>9} {'vs flex':>8} {'vs dense':>9} "
          f"{'rel L2':>8}")
    for name, c in rows:
        print(f"{name:>14} {c['fraction']:7.1%} {c['openvc_ms']:10.2f} {c['openvc_tflops']:6.0f} {c['flex_ms']:9.2f} "
              f"{c['vs_flex']:7.2f}x {c.get('vs_openvc_dense', float('nan')):8.2f}x "
              f"{c.get('rel_l2_vs_flex_block_level', float('nan')):8.4f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"shape": {"S": S, "H": H, "D": D, "frames": args.frames,
                             "tokens_per_frame": args.tokens_per_frame},
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rounds": args.rounds, "cases": dict(rows),
                   "times_ms": {f"{a}/{b}": t for (a, b), t in times.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
