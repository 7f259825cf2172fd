"""openvc inside yunchang's sequence-parallel attention (Ulysses x ring), on GPUs (docs/integrations/yunchang.md).

    torchrun --nproc-per-node 1 examples/yunchang_long_context.py                  # one GPU: degrees 1 x 1
    torchrun --nproc-per-node 4 examples/yunchang_long_context.py --ulysses 2 --ring 2

Every rank builds the same random q, k, v ([1, S, H, 128], BF16), runs yunchang's LongContextAttention with
openvc's attn_processor on its sequence shard, and compares its output rows with torch SDPA (BF16) over the
whole sequence. Rank 0 prints each rank's relative L2 error and routing counts (the openvc calls: one per
ring step); exit status 1 when an error exceeds --max-rel-l2 or no call took openvc. Needs torch with
CUDA, yunchang and a Hopper GPU per rank.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ulysses", type=int, default=1, help="Ulysses degree (divides --heads)")
    ap.add_argument("--ring", type=int, default=1, help="ring degree")
    ap.add_argument("--seqlen", type=int, default=32768, help="tokens of the whole sequence")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-rel-l2", type=float, default=0.08, help="per rank, vs BF16 SDPA (ExpCast FP8 error)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from yunchang import set_seq_parallel_pg

    from open_vc_attn.integrations import yunchang as openvc_yunchang

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.ulysses * args.ring:
        raise SystemExit(f"--ulysses x --ring = {args.ulysses * args.ring}, but {world} processes run")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    set_seq_parallel_pg(args.ulysses, args.ring, rank, world)
    attn = openvc_yunchang.long_context_attention()

    g = torch.Generator(device="cuda").manual_seed(0)        # the same tensors on every rank
    q, k, v = (torch.randn(1, args.seqlen, args.heads, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    n = args.seqlen // world
    shard = slice(rank * n, (rank + 1) * n)                   # yunchang's basic layout: contiguous shards
    with torch.inference_mode():
        out = attn(q[:, shard].contiguous(), k[:, shard].contiguous(), v[:, shard].contiguous(),
                   softmax_scale=128 ** -0.5)
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    ref = ref.transpose(1, 2)[:, shard]
    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
    routes = {f"{p}{': ' + why if why else ''}": c for (p, why), c in openvc_yunchang.stats().items()}
    results = [None] * world
    dist.all_gather_object(results, {"rank": rank, "rel_l2": rel, "routes": routes})
    ok = all(r["rel_l2"] <= args.max_rel_l2 and r["routes"].get("openvc", 0) > 0 for r in results)
    if rank == 0:
        print(f"yunchang LongContextAttention + openvc, S = {args.seqlen}, H = {args.heads}, D = 128, "
              f"ulysses {args.ulysses} x ring {args.ring}")
        for r in results:
            print(f"  rank {r['rank']}: rel L2 vs SDPA {r['rel_l2']:.3%}, routes {r['routes']}")
        print("OK" if ok else f"FAIL: rel L2 > {args.max_rel_l2:.1%} or no call on openvc")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
