"""CPU tests of bench.modes' sparse case group (issue 26, item 8): the case list, the random block lists, the
visited-block FLOPs, the block-level FlexAttention mask, the record fields, the acceptance lines and check.sh's
modes-sparse step. No GPU."""
import json
import math
import os
import subprocess
import types

import numpy as np
import pytest

from open_vc_attn.bench import harness, modes, sparse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sparse_case_list():
    assert "sparse" in modes.CASES and "sparse" not in modes.DEFAULT_CASES   # asked for by name
    cases = modes.case_list(modes.parse_cases("sparse"))
    names = [n for n, _ in cases]
    assert names == ["sparse-dense", "sparse-window2", "sparse-frame-causal", "sparse-chunked-causal",
                     "sparse-random-d10", "sparse-random-d20", "sparse-random-d30", "sparse-random-d50",
                     "sparse-random-d70", "sparse-random-d100", "sparse-radial"]
    for _, spec in cases:
        assert spec["kind"] == "sparse" and spec["frames"] * spec["tpf"] == 75600 and spec["h"] == 40
        json.dumps(spec)
    specs = dict(cases)
    assert specs["sparse-window2"]["radius"] == 2 and specs["sparse-chunked-causal"]["chunk"] == 3600
    assert [specs[n]["density"] for n in names if "random" in n] == [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]


@pytest.mark.parametrize("density", sparse.DENSITIES)
def test_random_block_lists_density_and_order(density):
    n = sparse.tiles(75600)
    assert n == 591
    counts, indices = sparse.random_block_lists(n, n, density, seed=0)
    assert counts.dtype == np.int32 and indices.dtype == np.int32 and indices.shape == (n, n)
    keep = round(density * n)
    assert (counts == keep).all()
    assert abs(counts.sum() / (n * n) - density) < 1e-3
    listed = indices[:, :keep]
    assert (np.diff(listed, axis=1) > 0).all() and listed.min() >= 0 and listed.max() < n
    assert (indices[:, keep:] == 0).all()
    if density < 1:   # a random subset per tile, not the same one
        assert len({tuple(r) for r in listed[:20]}) == 20


def test_random_block_lists_deterministic_per_seed():
    a = sparse.random_block_lists(50, 60, 0.3, seed=0)
    b = sparse.random_block_lists(50, 60, 0.3, seed=0)
    c = sparse.random_block_lists(50, 60, 0.3, seed=1)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (a[1] == c[1]).all()
    assert sparse.random_block_lists(4, 5, 0.01, 0)[0].tolist() == [1] * 4   # at least one block a tile
    with pytest.raises(ValueError, match="density"):
        sparse.random_block_lists(4, 4, 0.0, 0)


def test_visited_flops_and_tflops():
    # 4 * 128 * 128 * D per block per head; all 591^2 blocks at H = 40 is the S x S count up to the padding.
    assert sparse.visited_flops(1, heads=1, head_dim=128) == 4 * 128 * 128 * 128
    full = sparse.visited_flops(591 * 591)
    dense = harness.attention_flops(1, 40, 75600, 75600, 128)
    assert 1.0 < full / dense < 1.0013
    # The docs' window row: 22.7% of the blocks in 25.3 ms is ~1050 TF/s.
    blocks = round(0.227 * 591 * 591)
    assert harness.tflops(sparse.visited_flops(blocks), 25.3) == pytest.approx(1050, rel=0.01)


def _rec(case, pattern, density, openvc_ms, flex_ms=None, rel=0.056):
    spec = dict(kind="sparse", frames=21, tpf=3600, h=40, pattern=pattern)
    visited = round(density * 591 * 591)
    flops = sparse.visited_flops(visited) if pattern != "dense" else harness.attention_flops(1, 40, 75600, 75600, 128)
    res = {"openvc": {"median_ms": openvc_ms, "tflops": harness.tflops(flops, openvc_ms),
                      "samples_ms": [openvc_ms] * 3}}
    if flex_ms is not None:
        res["flex-bf16"] = {"median_ms": flex_ms, "tflops": harness.tflops(flops, flex_ms),
                            "samples_ms": [flex_ms, flex_ms * 1.1, flex_ms * 0.9]}
    rec = {"case": case, "spec": spec, "results": res, "visited_blocks_per_head": visited, "density": density,
           "total_blocks_per_head": 591 * 591}
    if pattern != "dense":
        rec["rel_l2_vs_flex"] = rel
    rec["sparse"] = sparse.summarize(rec, sparse.dense_reference([rec]) if pattern == "dense" else None)
    return rec


def _run(window_ms=25.3, window_flex=68.2, causal_flex=151.1, slow_density=None):
    recs = [_rec("sparse-dense", "dense", 1.0, 100.0)]
    dense = sparse.dense_reference(recs)
    rows = [("sparse-window2", "window", 0.227, window_ms, window_flex),
            ("sparse-frame-causal", "frame_causal", 0.525, 57.3, causal_flex),
            ("sparse-chunked-causal", "chunked_causal", 0.525, 55.4, causal_flex)]
    rows += [(f"sparse-random-d{round(100 * d)}", "random", d, 100.0 * d * (1.2 if d == slow_density else 1.0),
              270.0 * d) for d in sparse.DENSITIES]
    for case, pattern, d, ms, fx in rows:
        r = _rec(case, pattern, d, ms, fx)
        r["sparse"] = sparse.summarize(r, dense)
        recs.append(r)
    return recs


def test_summarize_record_fields():
    recs = _run()
    s = {r["case"]: r["sparse"] for r in recs}
    w = s["sparse-window2"]
    for key in ("pattern", "density", "visited_blocks_per_head", "total_blocks_per_head", "openvc_ms",
                "tflops_visited", "flex_ms", "flex_tflops_visited", "dense_ms", "dense_tflops", "tflops_over_dense",
                "time_over_dense", "speedup_vs_flex", "speedup_vs_flex_per_round", "rel_l2_vs_flex"):
        assert key in w, key
    assert w["time_over_dense"] == pytest.approx(0.253)
    assert w["speedup_vs_flex_per_round"] == pytest.approx([68.2 / 25.3, 1.1 * 68.2 / 25.3, 0.9 * 68.2 / 25.3])
    assert w["speedup_vs_flex"] == pytest.approx(68.2 / 25.3)
    assert w["tflops_visited"] / w["dense_tflops"] == pytest.approx(w["tflops_over_dense"])
    assert s["sparse-dense"]["tflops_over_dense"] == 1.0 and math.isnan(s["sparse-dense"]["speedup_vs_flex"])
    assert s["sparse-random-d50"]["tflops_over_dense"] == pytest.approx(1.0, rel=2e-3)
    json.dumps(recs)
    assert "sparse-random-d100" in sparse.format_case("sparse-random-d100", s["sparse-random-d100"])
    no_ref = sparse.summarize(recs[1], None)   # no dense record (it failed): ratios are NaN, not an error
    assert math.isnan(no_ref["tflops_over_dense"]) and math.isnan(no_ref["time_over_dense"])


def test_acceptance_lines():
    rows = sparse.acceptance(_run())
    assert len(rows) == 5 + 2 + 2   # densities 20..100%, the window's two lines, frame causal and chunked causal
    assert all(r["pass"] for r in rows), rows
    assert "10%" not in " ".join(r["check"] for r in rows)
    text = sparse.format_acceptance(rows)
    assert text.count("PASS") == 9 and "FAIL" not in text

    rows = {r["case"]: r for r in sparse.acceptance(_run(window_ms=35.0, causal_flex=100.0, slow_density=0.3))}
    assert rows["sparse-random-d30"]["pass"] is False and rows["sparse-random-d50"]["pass"] is True
    assert rows["sparse-frame-causal"]["pass"] is False   # 100 / 57.3 < 2.0
    window = [r for r in sparse.acceptance(_run(window_ms=35.0)) if r["case"] == "sparse-window2"]
    assert [r["pass"] for r in window] == [False, False]   # 0.35x dense time; 68.2 / 35 < 2.3
    assert "FAIL" in sparse.format_acceptance(list(rows.values()))


def test_acceptance_without_flex_or_cases():
    assert sparse.acceptance([{"case": "dense-S73397-H7", "results": {}}]) == []
    recs = _run(window_flex=None, causal_flex=None)
    recs = [r for r in recs if r["case"] != "sparse-random-d70"]   # a case that failed
    rows = {r["case"]: r for r in sparse.acceptance(recs)}
    assert rows["sparse-random-d70"]["pass"] is None
    assert rows["sparse-frame-causal"]["pass"] is None and rows["sparse-random-d20"]["pass"] is True
    assert [r["pass"] for r in sparse.acceptance(recs) if r["case"] == "sparse-window2"] == [True, None]
    assert "n/a" in sparse.format_acceptance(list(rows.values()))


def test_flex_support_missing(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    fn, why = sparse.flex_support()
    assert fn is None and "flex_attention" in why


def _fake_flex(torch, masks):
    """FlexAttention's compiled semantics at a tiny S (its eager path evaluates mask_mod everywhere and ignores
    the block lists): the listed blocks (partial and full), mask_mod applied in the partial ones. [B, H, S, D]."""
    def flex(qt, kt, vt, block_mask):
        s = qt.shape[2]
        counts, indices = masks.block_lists(block_mask)
        occ = torch.zeros(counts.shape[-1], indices.shape[-1], dtype=torch.bool)
        for r, (c, row) in enumerate(zip(counts.reshape(-1).tolist(), indices.reshape(-1, indices.shape[-1]))):
            occ[r, row[:c].long()] = True
        listed = occ.repeat_interleave(128, 0).repeat_interleave(128, 1)[:s, :s]
        pos = torch.arange(s)
        zero = torch.zeros((), dtype=torch.int64)
        element = torch.broadcast_to(block_mask.mask_mod(zero, zero, pos[:, None], pos[None, :]), (s, s))
        out = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                               attn_mask=listed & element)
        return out.to(qt.dtype)
    return flex


@pytest.mark.parametrize("pattern", ["random", "window", "chunked_causal"])
def test_build_case_on_cpu(pattern):
    """build_case's plumbing at a tiny shape on CPU (FlexAttention and openvc replaced by exact models of what
    they compute): the entries, FLOPs, the info fields, and rel L2 ~0 (the full-block mask of the rel-L2
    reference lists exactly openvc's blocks, a partial last tile included; chunked causal is element-exact)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.nn.attention.flex_attention")
    from open_vc_attn import masks
    spec = dict(kind="sparse", frames=3, tpf=200, h=2, d=64, pattern=pattern, density=0.4, seed=3, radius=0,
                chunk=200)
    calls = []
    flex = _fake_flex(torch, masks)

    def attention(q, k, v, *, block_mask=None, causal=False, causal_chunk=1):
        calls.append((block_mask is not None, causal, causal_chunk))
        if causal:
            block_mask = masks.frame_causal(3, 200, device="cpu")
        else:   # openvc visits the listed blocks whole: the full-block form of the same lists
            block_mask = sparse.full_block_mask(torch, *masks.block_lists(block_mask), q.shape[1])
        return flex(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask).transpose(1, 2)

    state = {"flex": flex, "flex_why": None}
    entries, flops, skipped, info = sparse.build_case(torch, types.SimpleNamespace(attention=attention), spec,
                                                      state, device="cpu")
    assert set(entries) == {"openvc", "flex-bf16"} and isinstance(entries["flex-bf16"], modes.Eager)
    assert skipped == {} and info["total_blocks_per_head"] == 25
    if pattern == "random":
        assert info["visited_blocks_per_head"] == 5 * 2 and info["density"] == pytest.approx(0.4)
    if pattern == "window":   # radius 0 at 200 tokens a frame: tiles 0-1 | 1-3 | 3-4 (tile 1 and 3 straddle)
        assert info["visited_blocks_per_head"] == 4 + 9 + 4 - 2
    assert flops["openvc"] == flops["flex-bf16"] == sparse.visited_flops(info["visited_blocks_per_head"], 2, 64)
    assert info["rel_l2_vs_flex"] < 1e-6, info
    assert calls[-1] == ((False, True, 200) if pattern == "chunked_causal" else (True, False, 1))
    assert entries["flex-bf16"].fn().shape == (1, 2, 600, 64)
    if pattern == "window":   # the timed FlexAttention call applies the element rule: not openvc's attention
        got = entries["flex-bf16"].fn().transpose(1, 2)
        assert harness.error_metrics_torch(entries["openvc"](), got)["rel_l2"] > 0.01

    dense_entries, dense_flops, dense_skipped, dense_info = sparse.build_case(
        torch, types.SimpleNamespace(attention=attention), dict(spec, pattern="dense"), state, device="cpu")
    assert set(dense_entries) == {"openvc"} and "flex-bf16" in dense_skipped and dense_info["reference"]
    assert dense_flops["openvc"] == harness.attention_flops(1, 2, 600, 600, 64)


def test_build_case_without_flex():
    torch = pytest.importorskip("torch")
    spec = dict(kind="sparse", frames=2, tpf=128, h=1, d=64, pattern="random", density=0.5, seed=0)
    state = {"flex": None, "flex_why": "not importable"}
    entries, _, skipped, info = sparse.build_case(torch, types.SimpleNamespace(attention=None), spec, state,
                                                  device="cpu")
    assert set(entries) == {"openvc"} and skipped == {"flex-bf16": "not importable"}
    assert "rel_l2_vs_flex" not in info and info["visited_blocks_per_head"] == 2


def test_check_sh_modes_sparse_step():
    script = os.path.join(REPO, "scripts", "device", "check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    out = subprocess.run(["bash", script, "help"], capture_output=True, text=True).stdout
    assert "  modes-sparse " in out
    text = open(script).read()
    assert "step_modes_sparse()" in text and "--cases sparse" in text and " modes-sparse " in text
    assert "`modes-sparse`" in open(os.path.join(REPO, "scripts", "README.md")).read()
