"""CPU tests of the issue-25 benchmark paths: SageAttention2 as a backend (availability, eager timing
flag), bench.modes' int8 case (case list, arguments, paired ratios), bench.qk_tradeoff (arguments, inputs,
FP64 reference, record schema, table and PNG from a synthetic record) and check.sh's new steps. No GPU."""
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from open_vc_attn.bench import backends, modes, qk_tradeoff as qt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- SageAttention2 backend -----------------------------------------------------------------------------

def test_sage2_missing_when_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "sageattention", None)   # import raises ImportError
    status, why = backends.available("sage2")
    assert status == "missing" and "sageattention" in why
    with pytest.raises(backends.Missing):
        backends.build("sage2", types.SimpleNamespace(q=1, k=2, v=3, softmax_scale=None), "complete")
    assert qt.method_status("sage2")[0] == "missing"
    assert modes._sage2() is None
    assert modes._sage2_entries(1, 2, 3, False) == {}


def test_sage2_backend_is_eager_and_calls_nhd(monkeypatch):
    calls = []
    fake = types.ModuleType("sageattention")
    fake.sageattn = lambda q, k, v, **kw: calls.append((q, k, v, kw)) or "out"
    monkeypatch.setitem(sys.modules, "sageattention", fake)
    assert backends.available("sage2") == ("ok", None)
    assert backends.BACKENDS["sage2"][2] == ("complete",) and "sage2" in backends.EAGER_ONLY
    built = backends.build("sage2", types.SimpleNamespace(q="q", k="k", v="v", softmax_scale=None), "complete")
    assert built.eager is True
    assert built.to_bshd(built.fn()) == "out"
    assert calls == [("q", "k", "v", {"tensor_layout": "NHD", "is_causal": False})]
    entries = modes._sage2_entries("q", "k", "v", True)
    assert isinstance(entries["sage2"], modes.Eager)
    entries["sage2"].fn()
    assert calls[-1][3] == {"tensor_layout": "NHD", "is_causal": True}


def test_other_backends_are_not_eager():
    assert backends.Built(fn=lambda: None).eager is False


# ---- bench.modes int8 case ------------------------------------------------------------------------------

def test_modes_int8_case_is_issue25_shapes():
    cases = modes.case_list(modes.parse_cases("int8"))
    got = [(c["s"], c["h"], c.get("d", 128), c.get("causal", False)) for _, c in cases]
    assert got == [(73397, 7, 128, False), (73397, 56, 128, False), (32760, 40, 128, False),
                   (32768, 7, 128, True), (24576, 32, 64, False)]
    assert all(c["kind"] == "qk" for _, c in cases)
    assert set(modes.QK_FORMATS) == {"e4m3", "int8", "int8+smooth", "int8+smooth+exp2", "int8+smooth+exp2+vbias"}
    assert modes.QK_FORMATS["int8+smooth+exp2+vbias"] == {"qk_format": "int8", "k_smoothing": True,
                                                          "p_format": "exp2", "v_bias_correction": True}
    assert modes.QK_FORMATS["int8+smooth"] == {"qk_format": "int8", "k_smoothing": True}
    assert modes.QK_FORMATS["int8+smooth+exp2"] == {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2"}


def test_modes_cross_case_is_issue28_shapes():
    cases = modes.case_list(modes.parse_cases("cross"))
    assert [(c["kind"], c["sq"], c["sk"], c["h"]) for _, c in cases] == [("cross", 32760, 512, 40),
                                                                          ("cross", 75600, 512, 40)]
    assert "cross" not in modes.DEFAULT_CASES


def test_modes_short_case_is_issue28_shapes():
    cases = dict(modes.case_list(modes.parse_cases("short")))
    dense = [(c.get("b", 1), c["s"], c["h"], c.get("causal", False)) for c in cases.values() if c["kind"] == "dense"]
    assert dense == [(1, 4096, 7, False), (1, 8192, 40, False), (1, 16384, 24, True), (2, 32760, 12, False)]
    packed = cases["short-packed-8x9000-H24"]
    assert (packed["kind"], packed["lens"], packed["h"], packed["peers"]) == ("packed", (9000,) * 8, 24, True)
    assert "short" not in modes.DEFAULT_CASES


def test_modes_arguments():
    args = modes.parser().parse_args([])
    assert "int8" not in args.cases.split(",")        # asked for by name only
    assert modes.parse_cases("dense, int8") == ["dense", "int8"]
    with pytest.raises(ValueError, match="--cases"):
        modes.parse_cases("dense,int4")
    args = modes.parser().parse_args(["--cases", "int8", "--rounds", "7", "--seed", "3", "--out", "x.json"])
    assert (args.cases, args.rounds, args.seed, args.out) == ("int8", 7, 3, "x.json")


def test_modes_paired_table_and_counterparts():
    assert modes.counterpart("openvc-int8+smooth-eager") == "openvc-e4m3-eager"
    assert modes.counterpart("openvc-int8-kernel") == "openvc-e4m3-kernel"
    assert modes.counterpart("openvc-int8") == "openvc-e4m3"
    assert modes.counterpart("openvc-e4m3") is None and modes.counterpart("sage2") is None
    samples = {"openvc-int8": [1.0, 2.0, 1.0], "openvc-e4m3": [1.0, 1.0, 1.0], "sage2": [2.0, 2.0, 3.0],
               "fa3-fp8": [1.5, 1.5, 1.5], "cudnn-bf16": [3.0, 3.0, 3.0]}
    t = modes.paired_table(samples)
    assert t["openvc-int8_vs_sage2"]["per_round"] == [2.0, 1.0, 3.0]
    assert t["openvc-int8_vs_sage2"]["median"] == 2.0
    assert t["openvc-int8_vs_openvc-e4m3"]["per_round"] == [1.0, 0.5, 1.0]
    assert t["openvc-e4m3_vs_fa3-fp8"]["median"] == 1.5
    assert "openvc-e4m3_vs_openvc-e4m3" not in t and not any(k.startswith("sage2") for k in t)
    json.dumps(t)   # the record's JSON


def test_modes_exp2_pairing():
    """int8+smooth+exp2 entries pair with E4M3 like the other INT8 entries, and with their ExpCast twin."""
    for form in ("", "-eager", "-kernel"):
        assert modes.counterpart(f"openvc-int8+smooth+exp2{form}") == f"openvc-e4m3{form}"
        assert modes.expcast_counterpart(f"openvc-int8+smooth+exp2{form}") == f"openvc-int8+smooth{form}"
    assert modes.expcast_counterpart("openvc-int8+smooth") is None and modes.expcast_counterpart("sage2") is None
    # the V-bias-corrected entry: against E4M3 and its uncorrected twin
    assert modes.counterpart("openvc-int8+smooth+exp2+vbias-eager") == "openvc-e4m3-eager"
    assert modes.expcast_counterpart("openvc-int8+smooth+exp2+vbias-eager") == "openvc-int8+smooth+exp2-eager"
    samples = {"openvc-int8+smooth+exp2": [2.0, 2.0], "openvc-int8+smooth": [1.0, 2.0], "openvc-e4m3": [1.0, 1.0],
               "sage2": [4.0, 4.0]}
    t = modes.paired_table(samples)
    assert t["openvc-int8+smooth+exp2_vs_openvc-e4m3"]["per_round"] == [0.5, 0.5]
    assert t["openvc-int8+smooth+exp2_vs_openvc-int8+smooth"]["per_round"] == [0.5, 1.0]
    assert t["openvc-int8+smooth+exp2_vs_sage2"]["median"] == 2.0
    assert "openvc-int8+smooth_vs_openvc-int8+smooth+exp2" not in t


def _fake_ova(calls, with_p_format=True):
    """A stand-in for open_vc_attn recording the keyword arguments of its calls."""
    def attention(q, k, v, *, causal=False, qk_format="e4m3", k_smoothing=False, p_format="expcast",
                  v_bias_correction=False):
        kw = dict(qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format)
        calls.append(("attention", dict(kw, v_bias_correction=True) if v_bias_correction else kw))

    def old_attention(q, k, v, *, causal=False, qk_format="e4m3", k_smoothing=False):
        calls.append(("attention", dict(qk_format=qk_format, k_smoothing=k_smoothing)))

    def prepare_fp8(q, k, v, *, qk_format="e4m3", k_smoothing=False):
        calls.append(("prepare_fp8", dict(qk_format=qk_format, k_smoothing=k_smoothing)))
        return (qk_format, k_smoothing)

    def attention_fp8(prepared, *, causal=False, p_format="expcast"):
        calls.append(("attention_fp8", dict(prepared=prepared, p_format=p_format)))

    def old_attention_fp8(prepared, *, causal=False):
        calls.append(("attention_fp8", dict(prepared=prepared)))
    if with_p_format:
        return types.SimpleNamespace(attention=attention, prepare_fp8=prepare_fp8, attention_fp8=attention_fp8)
    return types.SimpleNamespace(attention=old_attention, prepare_fp8=prepare_fp8, attention_fp8=old_attention_fp8)


def _stub_case(monkeypatch):
    monkeypatch.setattr(modes, "_qkv", lambda torch, b, s, h, d, seed: ["q", "k", "v"])
    monkeypatch.setattr(modes, "_sdpa", lambda torch, q, k, v, causal=False, mask=None: (lambda: None))
    monkeypatch.setattr(modes, "_peer_entries", lambda torch, q, k, v, causal: {})
    monkeypatch.setattr(modes, "_fa3", lambda: None)
    monkeypatch.setattr(modes, "_sage2", lambda: None)


def test_p_format_support(monkeypatch):
    from open_vc_attn import _ext
    calls = []
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace(PFormat=object()))
    assert modes.p_format_support(_fake_ova(calls)) is None
    why = modes.p_format_support(_fake_ova(calls, with_p_format=False))
    assert "p_format" in why and "attention" in why
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace())   # an extension built before PFormat
    why = modes.p_format_support(_fake_ova(calls))
    assert "PFormat" in why

    def broken():
        raise ImportError("no _openvc_ext here")
    monkeypatch.setattr(_ext, "load", broken)
    assert "not loadable" in modes.p_format_support(_fake_ova(calls))


def test_modes_int8_case_entries_exp2(monkeypatch):
    """The exp2 entries: the complete call with p_format="exp2", the kernel entry on a preparation made
    without it (prepare_fp8 takes no p_format) and attended with it; skipped with the reason, never run as
    ExpCast, when the build has no P format."""
    from open_vc_attn import _ext
    _stub_case(monkeypatch)
    calls = []
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace(PFormat=object()))
    entries, flops, skipped = modes._qk_entries(None, _fake_ova(calls), 1, 256, 2)
    for form in ("", "-eager", "-kernel"):
        assert f"openvc-int8+smooth+exp2{form}" in entries and f"openvc-int8+smooth{form}" in entries
    assert ("prepare_fp8", {"qk_format": "int8", "k_smoothing": True}) in calls   # no p_format
    calls.clear()
    entries["openvc-int8+smooth+exp2"]()
    entries["openvc-int8+smooth+exp2-eager"].fn()
    entries["openvc-int8+smooth+exp2-kernel"]()
    entries["openvc-int8+smooth-kernel"]()
    exp2 = {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2"}
    assert calls == [("attention", exp2), ("attention", exp2),
                     ("attention_fp8", {"prepared": ("int8", True), "p_format": "exp2"}),
                     ("attention_fp8", {"prepared": ("int8", True), "p_format": "expcast"})]
    # the corrected entries: complete calls only
    assert "openvc-int8+smooth+exp2+vbias-eager" in entries and "openvc-int8+smooth+exp2+vbias-kernel" not in entries
    assert [k for k in skipped if k.startswith("openvc")] == ["openvc-int8+smooth+exp2+vbias-kernel"]
    calls.clear()
    entries["openvc-int8+smooth+exp2+vbias"]()
    assert calls == [("attention", dict(exp2, v_bias_correction=True))]
    # a build without PFormat: the exp2 entries are left out with the reason, the others stay
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace())
    entries, _, skipped = modes._qk_entries(None, _fake_ova([]), 1, 256, 2)
    assert not any("exp2" in e for e in entries) and "openvc-int8+smooth-kernel" in entries
    assert "PFormat" in skipped["openvc-int8+smooth+exp2"]
    entries, _, skipped = modes._qk_entries(None, _fake_ova([], with_p_format=False), 1, 256, 2)
    assert not any("exp2" in e for e in entries) and "p_format" in skipped["openvc-int8+smooth+exp2"]


def test_qk_tradeoff_exp2_method(monkeypatch):
    from open_vc_attn import _ext
    from open_vc_attn.bench import backends as bk
    assert qt.METHODS["openvc-int8+smooth+exp2"][2] == {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2"}
    assert list(qt.METHODS).index("openvc-int8+smooth+exp2") == list(qt.METHODS).index("openvc-int8+smooth") + 1
    assert "openvc-int8+smooth+exp2" in qt.parser().parse_args([]).methods
    monkeypatch.setattr(bk, "openvc_runtime", lambda: None)   # as on a GPU machine
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace())   # an extension without PFormat
    status, why = qt.method_status("openvc-int8+smooth+exp2", _fake_ova([]))
    assert status == "missing" and "PFormat" in why
    assert qt.method_status("openvc-int8+smooth", _fake_ova([])) == ("ok", None)
    status, why = qt.method_status("openvc-int8+smooth+exp2", _fake_ova([], with_p_format=False))
    assert status == "missing" and "p_format" in why
    monkeypatch.setattr(_ext, "load", lambda: types.SimpleNamespace(PFormat=object()))
    assert qt.method_status("openvc-int8+smooth+exp2", _fake_ova([])) == ("ok", None)


def test_qk_format_support_reads_the_signatures():
    def attention(q, k, v, *, causal=False, qk_format="e4m3", k_smoothing=False): ...

    def prepare_fp8(q, k, v, *, qk_format="e4m3", k_smoothing=False): ...

    def old_prepare_fp8(q, k, v): ...
    assert modes.qk_format_support(types.SimpleNamespace(attention=attention, prepare_fp8=prepare_fp8)) is None
    why = modes.qk_format_support(types.SimpleNamespace(attention=attention, prepare_fp8=old_prepare_fp8))
    assert "prepare_fp8" in why and "qk_format" in why


# ---- bench.qk_tradeoff ----------------------------------------------------------------------------------

def test_qk_tradeoff_arguments():
    a = qt.parser().parse_args([])
    assert a.methods == list(qt.METHODS) and a.inputs == list(qt.INPUTS) and a.seeds == [0]
    assert a.speed_shape == {"seqlen": 32760, "heads": 40, "head_dim": 128}
    assert (a.seqlen, a.heads, a.head_dim) == (4096, 4, 128)
    a = qt.parser().parse_args(["--seeds", "0,1,2", "--speed-shape", "none", "--methods", "openvc-int8,sage2",
                                "--inputs", "normal,koffset,video"])
    assert a.seeds == [0, 1, 2] and a.speed_shape is None and a.methods == ["openvc-int8", "sage2"]
    assert a.inputs == ["N(0,1)", "q x2, K offset", "video-like"]
    assert list(qt.INPUT_KEYS.values()) == list(qt.INPUTS)
    assert qt.parse_speed_shape("24576,32,64") == {"seqlen": 24576, "heads": 32, "head_dim": 64}
    for bad in (["--methods", "openvc-int4"], ["--speed-shape", "1,2,3,4"], ["--inputs", "N(0,1)"]):
        with pytest.raises(SystemExit):
            qt.parser().parse_args(bad)


def test_qk_tradeoff_methods_and_inputs_cover_the_issue():
    assert qt.ISSUE_INPUTS == ("N(0,1)", "q,k x4", "RMS-normed q,k x3", "sink key x300", "q x2, K offset")
    assert {m for m in qt.METHODS} >= {"openvc-e4m3", "openvc-int8", "openvc-int8+smooth", "openvc-e4m3+smooth",
                                      "sage2", "fa3-fp8", "cudnn-bf16"}


def test_qk_tradeoff_inputs_fresh_per_seed():
    a = qt.make_inputs(256, 2, 32, seed=0)
    b = qt.make_inputs(256, 2, 32, seed=0)
    c = qt.make_inputs(256, 2, 32, seed=1)
    assert list(a) == list(qt.INPUTS)
    for name in qt.INPUTS:
        assert a[name][0].shape == (256, 2, 32)
        np.testing.assert_array_equal(a[name][1], b[name][1])
        assert not np.array_equal(a[name][1], c[name][1]), name
        for x in a[name][:3]:   # BF16 values: the low 16 bits of the float32 pattern are zero
            assert not (np.ascontiguousarray(x).view(np.uint32) & 0xFFFF).any()
    q, k, _, _ = a["q x2, K offset"]
    # the per-channel offset dominates the channel means of K (4 N(0,1) against N(0,1)/sqrt(S) noise)
    assert np.abs(k.mean(axis=0)).mean() > 1.0 and abs(float(q.std()) - 2.0) < 0.2
    with pytest.raises(ValueError, match="inputs"):
        qt.make_inputs(256, 2, 32, names=("nope",))


def test_exact_attention_fp64_matches_numpy(torch):
    from open_vc_attn.bench.qk_formats import attention_fp64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, 2, 16)) for _ in range(3))
    got = qt.exact_attention_fp64(*(torch.from_numpy(x) for x in (q, k, v))).numpy()
    for h in range(2):
        want = attention_fp64(q[0, :, h], k[0, :, h], [v[0, :, h]], 0.25)[0]
        np.testing.assert_allclose(got[0, :, h], want, rtol=1e-12, atol=1e-12)
    r = torch.from_numpy(got)
    assert qt.rel_l2(r, r) == 0.0 and abs(qt.rel_l2(r * 1.01, r) - 0.01) < 1e-12


def test_measure_errors_plumbing_on_cpu(torch, monkeypatch):
    """measure_errors with stand-in methods on the CPU: an exact FP32 one and a failing one."""
    def fake_calls(name, q, k, v):
        if name == "broken":
            def boom():
                raise RuntimeError("no kernel")
            return {"complete": (boom, False)}
        return {"complete": (lambda: qt.exact_attention_fp64(q, k, v).float(), False)}
    monkeypatch.setattr(qt, "make_calls", fake_calls)
    errors, desc, failures = qt.measure_errors(["exact", "broken"], [0, 1], 128, 2, 16,
                                               inputs=("N(0,1)", "q x2, K offset"), log=lambda *_: None,
                                               device="cpu")
    assert set(errors) == {"0", "1"} and set(desc) == {"N(0,1)", "q x2, K offset"}
    for per_seed in errors.values():
        for row in per_seed.values():
            assert row["exact"] < 1e-6 and row["broken"] is None
    assert "no kernel" in failures["broken"]
    summary = qt.summarize(errors)
    assert set(summary) == {"exact"} and set(summary["exact"]) == {"N(0,1)", "q x2, K offset"}


def _synthetic_record():
    methods = {m: {"label": qt.METHODS[m][0], "status": "ok", "qk": qt.METHODS[m][2]}
               for m in ("openvc-e4m3", "openvc-int8+smooth", "openvc-int8+smooth+exp2", "sage2", "cudnn-bf16")}
    methods["fa3-fp8"] = {"label": qt.METHODS["fa3-fp8"][0], "status": "missing",
                          "reason": "flash_attn_interface: ModuleNotFoundError"}
    base = {"openvc-e4m3": 0.055, "openvc-int8+smooth": 0.041, "openvc-int8+smooth+exp2": 0.038, "sage2": 0.039,
            "cudnn-bf16": 0.002}
    errors = {str(seed): {inp: {m: e * (1 + 0.1 * i + 0.01 * seed) for m, e in base.items()}
                          for i, inp in enumerate(qt.INPUTS)} for seed in (0, 1)}
    t = lambda ms, method="cuda_graph": {"median_ms": ms, "tflops": 4 * 32760 ** 2 * 40 * 128 / ms / 1e9,
                                         "method": method, "calls_per_replay": 2, "samples_ms": [ms] * 3}
    speed = {"openvc-e4m3": {"complete": t(16.0), "eager": t(16.3, "eager")},
             "openvc-int8+smooth": {"complete": t(17.0), "eager": t(17.4, "eager")},
             "openvc-int8+smooth+exp2": {"complete": t(17.5), "eager": t(17.9, "eager")},
             "sage2": {"complete": t(23.0, "eager")}, "cudnn-bf16": {"complete": t(31.0)}}
    settings = {"seqlen": 4096, "heads": 4, "head_dim": 128, "seeds": [0, 1], "inputs": list(qt.INPUTS),
                "speed_shape": {"seqlen": 32760, "heads": 40, "head_dim": 128}, "rounds": 5,
                "reference": "exact attention in float64 on the GPU from the BF16 inputs"}
    return qt.new_record(settings, methods, errors, {i: f"about {i}" for i in qt.INPUTS}, speed,
                         environment={"gpu_name": "NVIDIA H200", "torch": "2.11"})


def test_qk_tradeoff_record_schema():
    rec = _synthetic_record()
    assert qt.validate_record(rec) == []
    assert qt.validate_record(json.loads(json.dumps(rec))) == []
    s = rec["summary"]["openvc-int8+smooth"]["N(0,1)"]
    assert math.isclose(s, 0.041 * (1 + 0.005))            # mean over the two seeds
    bad = json.loads(json.dumps(rec))
    bad["schema"] = "x"
    del bad["settings"]["seeds"]
    bad["methods"]["fa3-fp8"].pop("reason")
    bad["errors"]["0"]["N(0,1)"]["nope"] = "high"
    bad["speed"]["sage2"]["complete"] = {}
    errs = "\n".join(qt.validate_record(bad))
    for want in ("schema", "'seeds'", "fa3-fp8", "unknown method", "number or null", "median_ms"):
        assert want in errs, want


def test_qk_tradeoff_markdown_and_files(tmp_path, monkeypatch):
    rec = _synthetic_record()
    md = qt.markdown(rec)
    head = next(line for line in md.splitlines() if line.startswith("| method"))
    for i in qt.INPUTS:
        assert f" {i} |" in head
    assert "| openvc INT8 Q/K + K smoothing | 4.12% |" in md      # (0.041 * 1.0 + 0.041 * 1.01) / 2
    assert "| openvc INT8 Q/K + K smoothing, exp2 P | 3.82% |" in md   # (0.038 * 1.0 + 0.038 * 1.01) / 2
    assert "| 17.500 |" in md
    assert "| 17.000 | 1293 | graph | 17.400 | — |" in md and "| 23.000 | 956 | eager | — | — |" in md
    assert "Unavailable" in md and "flash_attn_interface" in md and "FA3 FP8" in md
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # as on a machine without it
    logs = []
    qt.write_outputs(rec, str(tmp_path / "sub" / "r.json"), log=logs.append)
    assert (tmp_path / "sub" / "r.md").read_text() == md
    assert qt.validate_record(json.loads((tmp_path / "sub" / "r.json").read_text())) == []
    assert not (tmp_path / "sub" / "r.png").exists() and qt.PNG_SKIP_MESSAGE in logs


def test_qk_tradeoff_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert qt.write_png(_synthetic_record(), str(tmp_path / "r.png"), log=lambda *_: None)
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_qk_tradeoff_main_without_gpu_reports_unavailable(tmp_path):
    """On this machine no method runs: the record says why for each, and nothing is measured."""
    out = tmp_path / "r.json"
    rc = qt.main(["--out", str(out), "--no-png", "--methods", "sage2,fa3-fp8,openvc-int8"])
    rec = json.loads(out.read_text())
    assert qt.validate_record(rec) == []
    if rc == 0:
        pytest.skip("a method is available here")
    assert rc == 1 and rec["errors"] == {} and rec["speed"] == {}
    assert all(info["status"] == "missing" and info["reason"] for info in rec["methods"].values())


# ---- check.sh -------------------------------------------------------------------------------------------

def test_check_sh_documents_new_steps():
    script = os.path.join(REPO, "scripts", "device", "check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    out = subprocess.run(["bash", script, "help"], capture_output=True, text=True).stdout
    for step in ("anchors", "modes-int8", "qk-tradeoff"):
        assert f"  {step} " in out or f"  {step}\n" in out, step
    readme = open(os.path.join(REPO, "scripts", "README.md")).read()
    for step in ("anchors", "modes-int8", "qk-tradeoff"):
        assert f"`{step}`" in readme, step


def test_modes_gqa_case_is_grouped_shapes():
    cases = dict(modes.case_list(modes.parse_cases("gqa")))
    got = [(c["s"], c["h"], c["hk"], c.get("causal", False)) for c in cases.values()]
    assert got == [(32760, 32, 8, False), (32768, 32, 8, True), (16384, 24, 1, False)]
    assert all(c["kind"] == "gqa" and c["h"] % c["hk"] == 0 for c in cases.values())
    assert "gqa" not in modes.DEFAULT_CASES


def test_fa3_quantization_per_head_and_per_kv_head_group():
    """bench.backends.quantize_per_head: descales per (batch, head), or per (batch, K/V head) for a GQA Q (FA3 takes
    q_descale [B, Hk]); the codes times the descales give x back within E4M3's rounding."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    x = torch.randn(2, 64, 8, 16, generator=torch.Generator().manual_seed(3))
    x[:, :, 5] *= 40.0                       # one head of group 1 sets that group's scale
    for groups, shape in ((None, (2, 8)), (8, (2, 8)), (2, (2, 2)), (1, (2, 1))):
        codes, descale = backends.quantize_per_head(x, groups)
        assert descale.shape == shape and codes.dtype == torch.float8_e4m3fn
        per_head = descale.repeat_interleave(8 // shape[1], dim=1)[:, None, :, None]
        err = (codes.float() * per_head - x).abs() / x.abs().amax(dim=(1, 3), keepdim=True)
        assert float(err.max()) < 0.07
    _, d2 = backends.quantize_per_head(x, 2)
    assert float(d2[0, 1]) > 8 * float(d2[0, 0])      # the scaled head's group only
