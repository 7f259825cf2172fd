import sys
sys.path.insert(0, "tests/python")
import torch, open_vc_attn as ova
from test_gpu_v_bias import expected_bias, randn
for d, sk in ((64, 900), (64, 513), (128, 900)):
    g = torch.Generator(device="cuda").manual_seed(7)
    b, sq, h, hk = 2, 300, 4, 4
    q, k = randn(torch, g, b, sq, h, d), randn(torch, g, b, sk, hk, d)
    base = (1.0 + 0.0123 * torch.arange(d, device="cuda") + 0.37 * torch.arange(hk, device="cuda")[:, None]
            + 0.11 * torch.arange(b, device="cuda")[:, None, None])
    v = (base[:, None] + 0.002 * torch.randn(b, sk, hk, d, device="cuda", generator=g)).to(torch.bfloat16)
    for fmt in ({}, dict(qk_format="int8")):
        plain = ova.attention(q, k, v, **fmt).float(); fixed = ova.attention(q, k, v, v_bias_correction=True, **fmt).float()
        got = (fixed - plain).double().mean(1); want = expected_bias(torch, v, [sk, sk])
        err = (got - want).abs()
        i = int(err.argmax()); bb, hh, ee = i // (h * d), (i // d) % h, i % d
        print(d, sk, fmt, "max err", err.max().item(), "at", (bb, hh, ee), "got", got[bb, hh, ee].item(), "want", want[bb, hh, ee].item(),
              "plain", plain[bb, :3, hh, ee].tolist(), "fixed", fixed[bb, :3, hh, ee].tolist(), flush=True)
