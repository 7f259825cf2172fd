"""One text cross-attention call (issue 28: 32,760 queries against 512 keys, H = 40, D = 128, BF16) on prepared
inputs, a few times, for Nsight Compute (`bash scripts/device/check.sh profile-cross`): the kernel that loses to
FA3 BF16 at this shape (docs/performance.md, eighth session). --complete: the one-call attention() instead, whose
kernel quantizes Q itself (kFusedQMode), to compare the two kernels' profiles.

    python3 scripts/device/cross_call.py [--sq 32760] [--sk 512] [--heads 40] [--calls 3] [--complete]
"""
import argparse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sq", type=int, default=32760)
    ap.add_argument("--sk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--complete", action="store_true", help="time attention(q, k, v) (Q quantized in the kernel)")
    args = ap.parse_args(argv)
    import torch
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, args.sq, args.heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, args.sk, args.heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    if args.complete:
        name, call = "attention", lambda: ova.attention(q, k, v)
    else:
        prepared = ova.prepare_fp8(q, k, v)
        name, call = "attention_fp8", lambda: ova.attention_fp8(prepared)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"cross_call: {args.calls} {name} calls, Sq {args.sq}, Sk {args.sk}, H {args.heads}")


if __name__ == "__main__":
    main()
