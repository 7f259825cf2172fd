#!/usr/bin/env python3
"""Ulysses sequence-parallel openvc attention (docs/integrations/ulysses.md), one process per GPU:

    torchrun --nproc_per_node=N examples/ulysses.py [--seqlen 32768] [--heads 40] [--fp8-all-to-all]

Each rank holds its shard of the video tokens, [1, S/N, H, 128]; ulysses_attention gathers the whole
sequence for H/N heads, runs open_vc_attn.attention on them and scatters the result back. Rank 0 checks
its output rows against single-GPU attention on the full inputs (equal bit for bit: the per-head
arithmetic is the same). N = 1 works on one GPU. S must be divisible by N (and S/N by 128 with
--fp8-all-to-all), H by N.
"""
import os

# NVLink SHARP / multicast off before torch and NCCL load (the device machines' KINDS.md asks for it).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import open_vc_attn  # noqa: E402
from open_vc_attn import parallel  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--fp8-all-to-all", action="store_true")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # plain `python3 examples/ulysses.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    s, h = args.seqlen, args.heads
    if s % world or h % world:
        raise SystemExit(f"--seqlen {s} and --heads {h} must be divisible by the world size {world}")

    g = torch.Generator(device="cuda").manual_seed(0)   # the same global inputs on every rank
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    shard = slice(rank * s // world, (rank + 1) * s // world)
    out = parallel.ulysses_attention(q[:, shard], k[:, shard], v[:, shard], fp8_all_to_all=args.fp8_all_to_all)

    if rank == 0:
        full = open_vc_attn.attention(q, k, v)
        same = torch.equal(out, full[:, shard])
        print(f"world {world}: rank 0 output {tuple(out.shape)}, equal to single-GPU attention: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
