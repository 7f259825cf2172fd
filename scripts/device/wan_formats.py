"""Issue 25's end-to-end acceptance line: diffusers' Wan transformer (examples/diffusers_wan.py's random model,
self-attention QK-norm weights x --sharpen) on native BF16 SDPA, openvc's formats and SageAttention2, same run.

    python3 scripts/device/wan_formats.py --json out.json      # GPU (sm_90a): 1.3b-480p and 14b-720p
    python3 scripts/device/wan_formats.py --dry-run            # CPU, tiny configs (routing and counting only)
    bash scripts/device/check.sh anchors wan-formats           # on the device, carried .whl/ and .anchors/

Line, per openvc mode (the default is openvc-e4m3): output rel L2 against native <= sage2's and
sage2_ms / openvc_ms >= 1.15. Backends, one model and input: native (diffusers' torch SDPA: the reference); openvc-e4m3,
-int8-smooth, -int8-smooth-exp2, -int8-smooth-exp2-vbias (the same with v_bias_correction=True; each
integrations.diffusers.apply with a DispatchPolicy); openvc-auto (DispatchPolicy(qk_format="auto"): each attention
module runs the four candidate formats on its first call and keeps the fastest within auto_tolerance of exact
attention on sampled rows; its routes name each call's choice); sage2: sageattn for the calls openvc takes
(Sage2Route), the text cross-attention left on SDPA. A warm-up forward per
backend gives the rel L2 and the calls by path, then --runs rounds time each backend once, in a seeded shuffled
order (harness.visiting_orders); medians. openvc-auto is not timed: apply() and remove() around each forward would
make every module choose again (the choice's first-call cost, not the format's); its forward is the timed one of
the format its modules chose (the record's "auto_same_as", when they all chose one). --dry-run: tiny configs on the
CPU, diffusers_e2e.py's kernel stand-in (_e2e_standins.py) and a fake sageattn (both torch SDPA), thresholds 100
tokens: checks routing and counting, measures nothing.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAD_DIM = 128
# name: heads, FFN width, latent frames x height x width (tokens: frames * height/2 * width/2), text (umT5)
CONFIGS = {"1.3b-480p": {"heads": 12, "ffn_dim": 8960, "latent": (21, 60, 104), "text_dim": 4096, "text_tokens": 512},
           "14b-720p": {"heads": 40, "ffn_dim": 13824, "latent": (21, 90, 160), "text_dim": 4096, "text_tokens": 512}}
TINY = {"ffn_dim": 64, "latent": (3, 16, 16), "text_dim": 32, "text_tokens": 12}     # 192 tokens, 12 text keys
TINY_HEADS = {"1.3b-480p": 2, "14b-720p": 4}   # distinct, so that the [B, H, S, D] check sees each config's
DRY_MIN_TOKENS = 100     # dry run: 192-token self-attention taken, 12-key cross-attention not, as at real sizes
SAGE2_MIN_SPEEDUP = 1.15
AUTO = "openvc-auto"          # warm-up only (rel L2, choices): see the module doc


def load(name, rel):
    """A repository file as a module (examples/ and scripts/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WAN = load("diffusers_wan", "examples/diffusers_wan.py")   # build_model, make_inputs, forward, rel_l2


class Sage2Route:
    """While active(): torch SDPA replaced by a router sending the calls openvc's policy takes to
    sageattn(q, k, v, "HND") and the rest to the original SDPA, counting both (and the shapes sage2 saw).
    diffusers 0.42.1's native backend (attention_dispatch._native_attention) calls
    torch.nn.functional.scaled_dot_product_attention(query=, key=, value=, ...) on [B, H, S, D] views of its
    [B, S, H, D] tensors, looking the attribute up at each call: that attribute is what is replaced."""

    def __init__(self, torch, sageattn, policy):
        self.torch, self.sageattn, self.policy = torch, sageattn, policy
        self.counts, self.shapes = collections.Counter(), set()

    def reason(self, q, k, attn_mask, dropout_p, is_causal, enable_gqa):
        """None when sage2 takes the call: what openvc's policy takes (no mask, lengths >= its thresholds)."""
        if attn_mask is not None or dropout_p or is_causal or enable_gqa:
            return "mask, dropout, causal or GQA"
        if q.dim() != 4 or q.shape[-1] not in self.policy.head_dims or q.dtype not in (self.torch.bfloat16,
                                                                                      self.torch.float16):
            return f"q {list(q.shape)} {q.dtype}"
        if q.shape[-2] < self.policy.min_query_tokens or k.shape[-2] < self.policy.min_key_tokens:
            return f"short: {q.shape[-2]} queries, {k.shape[-2]} keys"
        return None

    @contextlib.contextmanager
    def active(self):
        fn = self.torch.nn.functional
        sdpa = fn.scaled_dot_product_attention

        def route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            why = self.reason(query, key, attn_mask, dropout_p, is_causal, enable_gqa)
            if why is not None:
                self.counts[f"sdpa: {why}"] += 1
                return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
            self.counts["sage2"] += 1
            self.shapes.add(tuple(query.shape))
            sm_scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
            return self.sageattn(query, key, value, tensor_layout="HND", is_causal=False, sm_scale=sm_scale)

        fn.scaled_dot_product_attention = route
        try:
            yield
        finally:
            fn.scaled_dot_product_attention = sdpa


def fake_sageattn(torch):
    """--dry-run: sageattn's signature on torch SDPA in FP32 (the original SDPA, captured before any route)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
        assert tensor_layout == "HND" and not return_lse
        return sdpa(q.float(), k.float(), v.float(), is_causal=is_causal, scale=sm_scale).to(q.dtype)
    return sageattn


def timed_forward(torch, model, inputs, cuda):
    """(ms, output) of one forward: one CUDA event pair (a forward is tens to hundreds of ms); CPU: wall clock."""
    if not cuda:
        t0 = time.perf_counter()
        out = WAN.forward(model, inputs)
        return (time.perf_counter() - t0) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = WAN.forward(model, inputs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


@contextlib.contextmanager
def applied(ovd, model, policy):
    ovd.apply(model, policy=policy)
    try:
        yield
    finally:
        ovd.remove(model)


def run_config(name, cfg, layers, args, sage, policies):
    import torch
    from open_vc_attn.bench import harness
    from open_vc_attn.integrations import diffusers as ovd
    cuda, device = not args.dry_run, "cpu" if args.dry_run else "cuda"
    gc.collect()                      # the previous config's model and activations (also after a failure)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = WAN.build_model(heads=cfg["heads"], layers=layers, head_dim=HEAD_DIM, ffn_dim=cfg["ffn_dim"],
                            text_dim=cfg["text_dim"], sharpen=args.sharpen, device=device)
    f, h, w = cfg["latent"]
    inputs = WAN.make_inputs(frames=f, height=h, width=w, text_tokens=cfg["text_tokens"], text_dim=cfg["text_dim"],
                             device=device)
    rec = {"config": name, **cfg, "head_dim": HEAD_DIM, "dim": cfg["heads"] * HEAD_DIM, "layers": layers,
           "tokens": f * (h // 2) * (w // 2), "sharpen": args.sharpen, "dry_run": args.dry_run,
           "params": sum(p.numel() for p in model.parameters()), "backends": {}, "errors": {}}
    if sage:
        sage.shapes.clear()

    def routed(b):   # backend b's attention in the model while the context lasts
        return (sage.active() if b == "sage2" else applied(ovd, model, policies[b]) if b in policies
                else contextlib.nullcontext())

    names, outs = ["native"] + list(policies) + (["sage2"] if sage else []), {}
    for b in list(names):             # warm-up: the output for the rel L2 and the calls by path
        try:
            ovd.reset_stats()
            if sage:
                sage.counts.clear()
            with routed(b):
                _, outs[b] = timed_forward(torch, model, inputs, cuda)
            routes = ({} if b == "native" else dict(sage.counts) if b == "sage2" else
                      {f"{p}{': ' + r if r else ''}": n for (p, r), n in ovd.stats(model).items()})
            rec["backends"][b] = {"routes": routes, "rel_l2": WAN.rel_l2(outs[b], outs["native"])}
        except Exception as exc:      # noqa: BLE001 - a backend that fails is recorded, the others measured
            rec["errors"][b] = f"{type(exc).__name__}: {exc}"[:400]
            names.remove(b)
            print(f"[{name}] {b} FAILED: {rec['errors'][b]}", flush=True)
    del outs
    timed = [b for b in names if b != AUTO]
    if AUTO in names:   # the format every openvc call of the auto forward chose, when there is one
        # a route's reason names the choice by the fixed policy's label ("openvc: qk_format=int8, k_smoothing
        # (auto: rel L2 0.041 <= 0.05)"; E4M3's empty label as qk_format=e4m3: _auto_format.Choice.reason)
        backend_of = {f"openvc: {p.format_label or 'qk_format=e4m3'}": b for b, p in policies.items() if b != AUTO}
        chosen = {r.split(" (auto:")[0] for r in rec["backends"][AUTO]["routes"] if "auto:" in r}
        rec["auto_same_as"] = backend_of.get(chosen.pop()) if len(chosen) == 1 else None
    times = {b: [] for b in timed}
    for order in harness.visiting_orders(timed, args.runs, seed=0):
        for b in order:
            with routed(b):
                ms, out = timed_forward(torch, model, inputs, cuda)
            del out
            times[b].append(ms)
    med = {b: harness.median(t) for b, t in times.items()}
    for b in names:
        r = rec["backends"][b]
        r["fast_calls"] = sum(n for k, n in r["routes"].items() if k.startswith(("openvc", "sage2")))
        if b not in med:
            continue
        r.update(ms=med[b], times_ms=times[b], speedup_vs_native=med["native"] / med[b])
        if b in policies and "sage2" in names:
            s = rec["backends"]["sage2"]
            r.update(sage2_ms_over_ms=med["sage2"] / med[b],
                     sage2_ms_over_ms_paired=harness.paired_ratios(times["sage2"], times[b])["median"],
                     rel_l2_over_sage2=r["rel_l2"] / s["rel_l2"] if s["rel_l2"] > 0 else math.inf)
    if "sage2" in names:   # diffusers passes [B, H, S, D] to SDPA: H at dim 1 is the model's head count
        rec["sage2_shapes"] = sorted(list(s) for s in sage.shapes)
        rec["sage2_layout_ok"] = all(s[1] == cfg["heads"] and s[3] == HEAD_DIM for s in sage.shapes)
        rec["sage2_same_calls"] = {b: rec["backends"][b]["fast_calls"] == rec["backends"]["sage2"]["fast_calls"]
                                   for b in policies if b in names}
    # The line per openvc mode (the default is openvc-e4m3; which mode becomes the default is the question);
    # openvc-auto's speed is that of the format it chose (auto_same_as).
    rec["acceptance"] = {b: {"rel_l2_le_sage2": r["rel_l2"] <= rec["backends"]["sage2"]["rel_l2"],
                             "speed_ge_1.15x_sage2": r["sage2_ms_over_ms"] >= SAGE2_MIN_SPEEDUP}
                         for b, r in rec["backends"].items() if "sage2_ms_over_ms" in r}
    same = rec.get("auto_same_as")
    if "sage2" in names and AUTO in names and same in rec["acceptance"]:
        rec["acceptance"][AUTO] = {
            "rel_l2_le_sage2": rec["backends"][AUTO]["rel_l2"] <= rec["backends"]["sage2"]["rel_l2"],
            "speed_ge_1.15x_sage2": rec["acceptance"][same]["speed_ge_1.15x_sage2"]}
    if cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return rec


def table(rec):
    lines = [f"[{rec['config']}] Wan {rec['heads']} x {rec['head_dim']} (dim {rec['dim']}), FFN {rec['ffn_dim']}, "
             f"{rec['layers']} layers, {rec['tokens']:,} video + {rec['text_tokens']} text tokens, "
             f"{rec['params'] / 1e9:.2f} B params" + (f", peak {rec['peak_gib']:.1f} GiB" if "peak_gib" in rec else ""),
             ("| backend | ms/fwd | vs native | rel L2 vs native | sage2 ms / ms (paired) | rel L2 / sage2's | "
              "fast calls | routes |"), "|---|---|---|---|---|---|---|---|"]
    sage2_l2 = rec["backends"].get("sage2", {}).get("rel_l2")
    for b, r in rec["backends"].items():
        vs = f"{r['sage2_ms_over_ms']:.3f} ({r['sage2_ms_over_ms_paired']:.3f})" if "sage2_ms_over_ms" in r else "-"
        er = (f"{r['rel_l2_over_sage2']:.3f}" if "rel_l2_over_sage2" in r else
              f"{r['rel_l2'] / sage2_l2:.3f}" if b == AUTO and sage2_l2 else "-")
        ms, vn = ((f"{r['ms']:.2f}", f"{r['speedup_vs_native']:.3f}x") if "ms" in r else
                  (f"as {rec.get('auto_same_as') or 'its choices'}", "-"))
        lines.append(f"| {b} | {ms} | {vn} | {r['rel_l2']:.4%} | {vs} | {er} | {r['fast_calls']} | "
                     f"{r['routes'] or '-'} |")
    lines += [f"| {b} | error: {e} | | | | | | |" for b, e in rec["errors"].items()]
    if "sage2_layout_ok" in rec:
        lines.append(f"sage2: shapes {rec['sage2_shapes']} ([B, H, S, D]: {rec['sage2_layout_ok']}), same fast-path "
                     f"calls as: {rec['sage2_same_calls']}")
    for b, a in rec.get("acceptance", {}).items():
        lines.append(f"acceptance (issue 25, {b} vs sage2{', DRY RUN: meaningless' if rec['dry_run'] else ''}): "
                     f"rel L2 <= sage2's: {a['rel_l2_le_sage2']}; forward >= {SAGE2_MIN_SPEEDUP}x sage2's: "
                     f"{a['speed_ge_1.15x_sage2']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("--layers-13b", type=int, default=4, help="transformer blocks of 1.3b-480p")
    p.add_argument("--layers-14b", type=int, default=2, help="transformer blocks of 14b-720p")
    p.add_argument("--runs", type=int, default=5, help="timed rounds after the warm-up (each backend once)")
    p.add_argument("--sharpen", type=float, default=3.0, help="self-attention QK-norm weights x this (the example's)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, kernel stand-ins (routing check)")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs) or args.runs < 1:
        p.error(f"--configs: of {sorted(CONFIGS)}; --runs >= 1")

    import diffusers
    import torch
    from open_vc_attn.integrations import diffusers as ovd
    from open_vc_attn.integrations import policy as ovp
    if not args.dry_run and not torch.cuda.is_available():
        print("wan_formats: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    small = {"min_query_tokens": DRY_MIN_TOKENS, "min_key_tokens": DRY_MIN_TOKENS} if args.dry_run else {}
    policies = {"openvc-e4m3": ovp.DispatchPolicy(**small),
                "openvc-int8-smooth": ovp.DispatchPolicy(qk_format="int8", k_smoothing=True, **small),
                "openvc-int8-smooth-exp2": ovp.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2",
                                                              **small),
                "openvc-int8-smooth-exp2-vbias": ovp.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2",
                                                                    v_bias_correction=True, **small),
                AUTO: ovp.DispatchPolicy(qk_format="auto", **small)}
    if args.dry_run:
        sageattn, sage_note = fake_sageattn(torch), "fake (dry run: torch SDPA in FP32)"
    else:
        try:
            from sageattention import sageattn
            sage_note = "sageattention.sageattn from " + sys.modules["sageattention"].__file__
        except Exception as exc:   # noqa: BLE001 - any import failure: measured without sage2
            sageattn, sage_note = None, f"skipped: not importable ({type(exc).__name__}: {str(exc)[:200]})"
    print("wan_formats: sage2", sage_note, flush=True)
    sage = Sage2Route(torch, sageattn, policies["openvc-e4m3"]) if sageattn else None   # openvc's thresholds
    header = {"torch": torch.__version__, "diffusers": diffusers.__version__, "dry_run": args.dry_run,
              "gpu": torch.cuda.get_device_name() if not args.dry_run else None, "sage2": sage_note,
              "runs": args.runs, "sharpen": args.sharpen,
              "policies": {k: dataclasses.asdict(v) for k, v in policies.items()}}
    print("wan_formats:", json.dumps(header), flush=True)
    stand_in = (load("_e2e_standins", "scripts/device/_e2e_standins.py").fast_path_stand_in(torch, ovd, ovp)
                if args.dry_run else contextlib.nullcontext())
    records, failed = [], False
    with stand_in:
        for name in configs:
            cfg = dict(CONFIGS[name], **(dict(TINY, heads=TINY_HEADS[name]) if args.dry_run else {}))
            layers = 2 if args.dry_run else args.layers_13b if name == "1.3b-480p" else args.layers_14b
            try:
                records.append(run_config(name, cfg, layers, args, sage, policies))
                print(table(records[-1]), flush=True)
            except Exception as exc:   # noqa: BLE001 - one config's failure is reported, the next still runs
                import traceback
                traceback.print_exc()
                failed = True
                records.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**header, "configs": records}, fh, indent=1)
        print("wan_formats: wrote", args.json)
    return 1 if failed or any(r.get("errors") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
