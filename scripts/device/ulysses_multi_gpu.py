#!/usr/bin/env python3
"""Multi-GPU check of open_vc_attn.parallel.ulysses_attention (docs/integrations/ulysses.md).

    torchrun --nproc_per_node=N scripts/device/ulysses_multi_gpu.py [--heads 56] [--iters 5]

Every rank builds the same global q, k, v [B, S, H, 128] (seeded; rank 0's copy is broadcast so that they
are identical), runs ulysses_attention on its shard S/N, and the outputs and LSEs are gathered. Rank 0
compares them with single-GPU open_vc_attn.attention on the full inputs, bit for bit, and prints per rank
the mean attention time, all-to-all time (input + output all-to-alls, including waiting for the other
ranks), quantize / pack time (FP8 path) and end-to-end time, from CUDA events on the current stream.
Configurations: S = 73,728 with and without fp8_all_to_all (73,728 = 576 blocks of 128: a multiple of
128 * N for N in 1, 2, 3, 4, 6, 8), S = 73,400 with fp8_all_to_all=False (shards of 9,175 tokens at N = 8,
not multiples of 128: the BF16 path takes any S divisible by N), and S = 73,397 (the benchmark length)
with fp8_all_to_all=False, which is reported as skipped for N > 1: ulysses_attention needs equal shards
and 73,397 = 19 x 3863 splits evenly only for N = 1. Exit status 1 if any comparison differs.
"""
import os

# NVLink SHARP / multicast off (KINDS.md of the device machines): set before torch and NCCL load.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse   # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import open_vc_attn  # noqa: E402
from open_vc_attn import parallel  # noqa: E402
from open_vc_attn._layout import DEFAULT_MID_WINDOW_BLOCKS  # noqa: E402
from open_vc_attn.bench import harness  # noqa: E402


def make_inputs(args, s, device):
    """Global q, k, v [B, S, H, 128], identical on every rank (rank 0's are broadcast)."""
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16
    shape = (args.batch, s, args.heads, 128)
    if args.inputs == "video":
        if dist.get_rank() == 0:
            frames, height, width = 21, 48, 76   # 76,608 tokens >= 73,728, truncated to s
            p = open_vc_attn.video_inputs.generate(frames=frames, height=height, width=width, seqlen=s,
                                                   batch=args.batch, heads=args.heads, head_dim=128,
                                                   seed=args.seed, dtype=args.dtype)
            qkv = [torch.from_numpy(np.ascontiguousarray(x)).to(device, dtype) for x in (p.q, p.k, p.v)]
            del p
        else:
            qkv = [torch.empty(shape, dtype=dtype, device=device) for _ in range(3)]
    else:
        g = torch.Generator(device=device).manual_seed(args.seed)
        qkv = [torch.randn(shape, generator=g, device=device, dtype=torch.float32) for _ in range(3)]
        qkv[0] *= 1.5   # sharper attention than plain N(0, 1) scores
        qkv = [x.to(dtype) for x in qkv]
    for x in qkv:
        dist.broadcast(x, src=0)
    return qkv


def gather_seq(x, world):
    """[B, S/N, H, D] shards -> [B, S, H, D] on every rank."""
    buf = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(buf, x.contiguous())
    return buf.transpose(0, 1).reshape(x.shape[0], world * x.shape[1], *x.shape[2:])


def gather_heads(lse, world):
    """[B, H/N, S] per rank -> [B, H, S]."""
    buf = torch.empty((world, *lse.shape), dtype=lse.dtype, device=lse.device)
    dist.all_gather_into_tensor(buf, lse.contiguous())
    return buf.transpose(0, 1).reshape(lse.shape[0], world * lse.shape[1], lse.shape[2])


def run_config(args, s, fp8, world, me, device):
    if fp8 and s % (128 * world):
        return {"seqlen": s, "fp8_all_to_all": fp8, "skipped": f"S/N = {s / world:g} is not a multiple of 128"}
    if s % world:
        return {"seqlen": s, "fp8_all_to_all": fp8,
                "skipped": f"S = {s} does not split into {world} equal shards (ulysses_attention needs S/N tokens "
                           "on every rank; 73,397 = 19 x 3863 splits only for N = 1)"}
    q, k, v = make_inputs(args, s, device)
    sl = s // world
    qs, ks, vs = (x[:, me * sl:(me + 1) * sl].contiguous() for x in (q, k, v))
    if me != 0:
        del q, k, v
    call = dict(fp8_all_to_all=fp8, return_lse=True)

    for _ in range(args.warmup):
        parallel.ulysses_attention(qs, ks, vs, **call)
    torch.cuda.synchronize()
    dist.barrier()
    timer = harness.PhaseTimer()   # the phases inside, and end_to_end around, each call
    for _ in range(args.iters):
        dist.barrier()
        with timer("end_to_end"):
            out, lse = parallel._ulysses(qs, ks, vs, None, None, DEFAULT_MID_WINDOW_BLOCKS, True, fp8, timer=timer)
    times = {name: ms / args.iters for name, ms in timer.totals_ms().items()}
    all_times = [None] * world
    dist.all_gather_object(all_times, times)

    out_full, lse_full = gather_seq(out, world), gather_heads(lse, world)
    result = {"seqlen": s, "fp8_all_to_all": fp8, "world_size": world, "per_rank_ms": all_times}
    if me == 0:
        del qs, ks, vs
        want, want_lse = open_vc_attn.attention(q, k, v, return_lse=True)
        result["single_gpu_attention_ms"] = harness.eager_ms(lambda: open_vc_attn.attention(q, k, v), args.iters)
        same = torch.equal(out_full.view(torch.uint8), want.view(torch.uint8))
        same_lse = torch.equal(lse_full.view(torch.uint8), want_lse.view(torch.uint8))
        result["out_bit_equal"], result["lse_bit_equal"] = bool(same), bool(same_lse)
        if not same:
            diff = out_full.float() - want.float()
            result["out_mismatches"] = int((out_full.view(torch.uint8) != want.view(torch.uint8)).sum())
            result["out_max_abs_diff"] = float(diff.abs().max())
            result["out_rel_l2"] = float(diff.norm() / want.float().norm())
        if not same_lse:
            result["lse_max_abs_diff"] = float((lse_full - want_lse).abs().max())
        del want, want_lse, q, k, v
    torch.cuda.empty_cache()
    dist.barrier()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=56, help="H (divisible by the world size); default 56")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--inputs", choices=["random", "video"], default="random",
                    help="random: torch normal values from --seed; video: open_vc_attn.video_inputs on rank 0 "
                         "(slow on the CPU for many heads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--configs", default="73728:0,73728:1,73400:0,73397:0",
                    help="comma-separated S:fp8 pairs (fp8 1 = fp8_all_to_all=True)")
    ap.add_argument("--json", default=None, help="write the results of rank 0 to this file")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    try:
        dist.init_process_group("nccl", device_id=device)
    except TypeError:   # torch < 2.3: no device_id
        dist.init_process_group("nccl")
    world, me = dist.get_world_size(), dist.get_rank()
    if args.heads % world:
        if me == 0:
            print(f"--heads {args.heads} is not divisible by the world size {world}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)

    results, ok = [], True
    with torch.inference_mode():
        for item in args.configs.split(","):
            s_txt, fp8_txt = item.split(":")
            res = run_config(args, int(s_txt), fp8_txt.strip() == "1", world, me, device)
            results.append(res)
            if me != 0:
                continue
            head = f"S={res['seqlen']} fp8_all_to_all={res['fp8_all_to_all']} N={world} H={args.heads} B={args.batch}"
            if "skipped" in res:
                print(f"[ulysses] {head}: skipped ({res['skipped']})", flush=True)
                continue
            good = res["out_bit_equal"] and res["lse_bit_equal"]
            ok &= good
            diffs = {k: v for k, v in res.items() if k.startswith(('out_', 'lse_'))}
            print(f"[ulysses] {head}: out bit-equal {res['out_bit_equal']}, lse bit-equal {res['lse_bit_equal']}"
                  f"{'' if good else ' ' + json.dumps(diffs)}"
                  f"; single-GPU attention {res['single_gpu_attention_ms']:.2f} ms", flush=True)
            for r, t in enumerate(res["per_rank_ms"]):
                parts = " ".join(f"{name} {t[name]:.2f}" for name in
                                 ("attention", "all_to_all", "quantize", "pack", "end_to_end") if name in t)
                print(f"[ulysses]   rank {r}: {parts} (ms)", flush=True)
    if me == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "args": vars(args), "results": results, "ok": ok}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    if me == 0:
        print(f"[ulysses] {'PASS' if ok else 'FAIL'}: ulysses_attention vs single-GPU attention", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
