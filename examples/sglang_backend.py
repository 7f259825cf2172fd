"""openvc as SGLang diffusion's attention backend: selection, then a Wan-sized attention layer through it.

Real use, on a Hopper machine with sglang installed (docs/integrations/sglang.md):

    python -m open_vc_attn.integrations.sglang_cli generate --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "a red fox running through snow" --num-frames 81 --height 480 --width 832

This script needs no model weights: it installs the backend, asks SGLang's platform which backend it now
selects for head size 128, builds the impl with the arguments SGLang's attention layers pass, and runs
Wan 480p self-attention (32,760 tokens, 12 heads of 128) and text cross-attention (512 keys) through it,
against SGLang's own SDPA impl: relative L2 and time of each, and which path each call took.

    python examples/sglang_backend.py [--tokens 32760 --heads 12 --iters 10 --json out.json]

Where sglang's server dependencies are not installed (``import sglang.multimodal_gen`` fails), the
backend modules are loaded from the installed sglang without its package ``__init__`` files (as
tests/python/test_integrations_sglang.py does); the backend itself is the same. Exit status 1 when the
self-attention differs from SDPA by more than --max-rel-l2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import sys
import types


def import_sglang() -> str:
    """Imports sglang's attention backend modules; returns how."""
    try:
        importlib.import_module("sglang.multimodal_gen.runtime.layers.attention.backends.sdpa")
        return "full import"
    except Exception as exc:   # noqa: BLE001 - sglang's import chain needs its whole server stack
        why = f"{type(exc).__name__}: {exc}"
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    root = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    for name in ("sglang", "sglang.multimodal_gen", "sglang.multimodal_gen.runtime.layers",
                 "sglang.multimodal_gen.runtime.layers.attention"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    importlib.import_module("sglang.multimodal_gen.runtime.layers.attention.backends.sdpa")
    return f"backend modules only ({why})"


def timed(fn, iters):
    """Milliseconds per call, timed as the benchmark times it (open_vc_attn.bench.harness)."""
    from open_vc_attn.bench import harness
    return harness.median_ms(fn, rounds=iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32760, help="video tokens (Wan 480p, 81 frames: 32,760)")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-rel-l2", type=float, default=0.08)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    how = import_sglang()
    import torch
    from sglang.multimodal_gen.runtime import platforms
    from sglang.multimodal_gen.runtime.layers.attention.backends.sdpa import SDPAImpl
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
    from sglang.multimodal_gen.utils import resolve_obj_by_qualname

    from open_vc_attn.integrations import sglang as ovs

    platform = platforms.current_platform
    if not torch.cuda.is_available():
        print("FAIL: needs a GPU")
        return 1
    if type(platform).__name__ == "CpuPlatform":   # NVML not reachable (some sandboxes): use CUDA's class
        from sglang.multimodal_gen.runtime.platforms.cuda import CudaPlatform
        print(f"note: SGLang detected {type(platform).__name__} (NVML unavailable?); using CudaPlatform")
        platform = CudaPlatform
    ovs.install(platform=platform)
    qualname = platform.get_attn_backend_cls_str(AttentionBackendEnum.TORCH_SDPA, 128, torch.bfloat16)
    print(f"sglang: {how}\nplatform {getattr(platform, '__name__', type(platform).__name__)} selects {qualname}")
    backend = resolve_obj_by_qualname(qualname)

    d, h = 128, args.heads
    kw = dict(num_heads=h, head_size=d, causal=False, softmax_scale=d ** -0.5, num_kv_heads=h, prefix="attn1.impl")
    impl, sdpa = backend.get_impl_cls()(**kw), SDPAImpl(**kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.tokens, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    kt, vt = (torch.randn(1, args.text_tokens, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(2))
    ovs.reset_stats()
    res = {"sglang_import": how, "selected": qualname}
    for name, (kk, vv) in (("self", (k, v)), ("cross", (kt, vt))):
        out, ref = impl.forward(q, kk, vv, None), sdpa.forward(q, kk, vv, None)
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        ms = timed(lambda: impl.forward(q, kk, vv, None), args.iters)
        ms_ref = timed(lambda: sdpa.forward(q, kk, vv, None), args.iters)
        res[name] = {"rel_l2_vs_sdpa": err, "ms_openvc_backend": ms, "ms_sdpa": ms_ref}
        print(f"{name}-attention, {args.tokens} x {kk.shape[1]} tokens, {h} heads: rel L2 vs SDPA {err:.3%}, "
              f"openvc backend {ms:.2f} ms, SDPA {ms_ref:.2f} ms ({ms_ref / ms:.2f}x)")
    res["routes"] = {f"{p}{': ' + w if w else ''}": n for (p, w), n in ovs.stats().items()}
    print(f"routes: {res['routes']}")
    ovs.uninstall()
    res["platform"] = str(platform)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = qualname == ovs.BACKEND_QUALNAME and res["self"]["rel_l2_vs_sdpa"] <= args.max_rel_l2
    if not ok:
        print("FAIL: openvc backend not selected, or self-attention rel L2 above --max-rel-l2")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
