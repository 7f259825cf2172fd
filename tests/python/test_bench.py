"""open_vc_attn.bench on the CPU: FLOP counting, paired-ratio math, visiting orders, presets, record
schema, report rendering from a stored fixture, input generation. Parts that need torch skip without it;
the end-to-end smoke run needs the GPU (marker ``gpu``)."""
import contextlib
import copy
import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from open_vc_attn import video_inputs as vi
from open_vc_attn.bench import backends, cli, harness, record, report

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "bench_record_fixture.json")


@pytest.fixture()
def fixture_record():
    with open(FIXTURE) as f:
        return json.load(f)


# ---- FLOPs, medians, ratios, orders ---------------------------------------------------------------------

def test_attention_flops_and_tflops():
    assert harness.attention_flops(1, 1, 1, 1, 1) == 4
    assert harness.attention_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11
    f = harness.attention_flops(1, 56, 73_397, 73_397, 128)
    assert f == 4 * 56 * 73_397 ** 2 * 128
    # The anchors file's FA3 FP8 figure: 910 TF at H=56 means ~170 ms per call.
    ms = f / 910e12 * 1e3
    assert harness.tflops(f, ms) == pytest.approx(910.0)
    assert math.isnan(harness.tflops(f, 0))


def test_median():
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert harness.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert harness.median([None, 1.0, float("nan"), 3.0]) == 2.0
    assert math.isnan(harness.median([]))


def test_paired_ratios_are_per_round_medians():
    anchor = [10.0, 20.0, 12.0, 11.0]   # round 2 ran while the clock dropped: both slow
    ours = [5.0, 10.0, 6.0, 5.0]
    r = harness.paired_ratios(anchor, ours)
    assert r["per_round"] == pytest.approx([2.0, 2.0, 2.0, 2.2])
    assert r["median"] == pytest.approx(2.0)
    # Not the ratio of medians: that would mix rounds (11.5 / 5.5 = 2.09).
    assert r["median"] != pytest.approx(harness.median(anchor) / harness.median(ours))
    # Rounds where one side has no sample are left out.
    r = harness.paired_ratios([10.0, None, 8.0], [5.0, 4.0, None])
    assert r["per_round"] == [2.0] and r["median"] == 2.0


def test_calls_per_replay():
    assert harness.calls_per_replay(0.1, 20.0) == 200
    assert harness.calls_per_replay(0.3, 20.0) == 67     # ceil: a replay lasts at least 20 ms
    assert harness.calls_per_replay(170.0, 20.0) == 1
    assert harness.calls_per_replay(1e-4, 20.0, max_calls=4096) == 4096
    assert harness.calls_per_replay(0.0) == 4096


def test_visiting_orders_deterministic_permutations():
    ids = [f"b{i}:attention" for i in range(6)]
    a = harness.visiting_orders(ids, 12, seed=3)
    assert a == harness.visiting_orders(ids, 12, seed=3)
    assert len(a) == 12 and all(sorted(o) == sorted(ids) for o in a)
    assert len({tuple(o) for o in a}) > 1          # rounds differ from each other
    assert a != harness.visiting_orders(ids, 12, seed=4)
    # Fixed expectation: orders must not change across Python versions or machines.
    assert harness.visiting_orders(["a", "b", "c"], 3, seed=0) == \
        [["a", "c", "b"], ["c", "b", "a"], ["a", "b", "c"]]


def test_finalize_metrics_matches_numpy():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(64, 8))
    out = ref + rng.normal(scale=0.01, size=ref.shape)
    d = out - ref
    m = harness.finalize_metrics(float((d * d).sum()), float((ref * ref).sum()), float((out * out).sum()),
                                 float((out * ref).sum()), float(np.abs(d).max()), out.size)
    assert m["rel_l2"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(ref))
    assert m["rmse"] == pytest.approx(np.sqrt(np.mean(d * d)))
    assert m["max_abs"] == pytest.approx(np.abs(d).max())
    assert m["cosine"] == pytest.approx((out * ref).sum() / np.linalg.norm(out) / np.linalg.norm(ref))
    assert set(m) == set(record.METRIC_KEYS)


def test_head_index_map_tiles():
    assert harness.head_index_map(7, 7) == list(range(7))
    assert harness.head_index_map(14, 7) == list(range(7)) * 2
    assert harness.head_index_map(40, 7)[35:] == [0, 1, 2, 3, 4]
    assert harness.head_index_map(2, 4) == [0, 1]
    with pytest.raises(ValueError):
        harness.head_index_map(0, 7)


class _FakeTorch:
    """Just enough of torch.cuda for Timer on the CPU: events read a fake clock that the 'kernel' of
    a test advances, and a graph replays the work that was recorded while capturing."""

    def __init__(self):
        self.clock = 0.0          # ms
        self.capturing = None
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        class Stream:
            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def __init__(self):
                self.work = []

            def replay(self):
                for w in self.work:
                    w()

        class graph:
            def __init__(self, g):
                self.g = g

            def __enter__(self):
                fake.capturing = self.g

            def __exit__(self, *exc):
                fake.capturing = None

        self.cuda = type("cuda", (), {})()
        self.cuda.Event, self.cuda.Stream, self.cuda.CUDAGraph, self.cuda.graph = Event, Stream, CUDAGraph, graph
        self.cuda.current_stream = lambda *a: Stream()
        self.cuda.stream = lambda s: contextlib.nullcontext()
        self.cuda.synchronize = lambda *a: None
        self.cuda.set_stream = lambda s: None

    def kernel(self, ms, launch_ms=0.0, capturable=True):
        """fn() of a backend whose GPU work lasts ms (plus launch_ms of eager launch overhead)."""
        def work():
            self.clock += ms

        def fn():
            if self.capturing is not None:
                if not capturable:
                    raise RuntimeError("operation not permitted when stream is capturing")
                self.capturing.work.append(work)
            else:
                self.clock += launch_ms
                work()
        return fn


def test_timer_sizes_replays_and_falls_back(monkeypatch):
    fake = _FakeTorch()
    monkeypatch.setattr(harness, "_torch", lambda: fake)
    # A 0.5 ms kernel: R = 40 calls per replay, one sample = 0.5 ms per call.
    t = harness.Timer(fake.kernel(0.5), target_ms=20.0)
    assert t.method == "cuda_graph" and t.calls == 40 and t.sample() == pytest.approx(0.5)
    # Launch overhead inflates the eager estimate; the replay-based re-sizing restores R.
    t = harness.Timer(fake.kernel(0.01, launch_ms=0.09), target_ms=20.0)
    assert t.calls == 2000 and t.sample() == pytest.approx(0.01)
    # Long calls: one per replay.
    assert harness.Timer(fake.kernel(170.0)).calls == 1
    # Capture fails: eager timing, marked, with the reason.
    t = harness.Timer(fake.kernel(2.0, launch_ms=0.1, capturable=False), target_ms=20.0)
    d = t.describe()
    assert d["method"] == "eager" and "capturing" in d["capture_error"] and t.calls == 10
    assert t.sample() == pytest.approx(2.1)
    # Cold L2: one call per replay, R flushed replays; the flush is outside the events.
    flushes = []
    t = harness.Timer(fake.kernel(0.5), target_ms=20.0, cold=True)
    assert (t.calls, t.cold_reps) == (1, 40)
    assert t.sample(lambda: flushes.append(fake.kernel(5.0)())) == pytest.approx(0.5) and len(flushes) == 40


def test_run_rounds_pairs_and_orders(monkeypatch):
    fake = _FakeTorch()
    monkeypatch.setattr(harness, "_torch", lambda: fake)
    timers = {"a": harness.Timer(fake.kernel(1.0)), "b": harness.Timer(fake.kernel(2.0))}
    samples, orders, errors = harness.run_rounds(timers, 5, seed=1)
    assert errors == {} and orders == harness.visiting_orders(["a", "b"], 5, 1)
    assert samples["a"] == pytest.approx([1.0] * 5) and samples["b"] == pytest.approx([2.0] * 5)
    assert harness.paired_ratios(samples["b"], samples["a"])["median"] == pytest.approx(2.0)


# ---- presets and inputs ---------------------------------------------------------------------------------

def test_presets():
    video = cli.preset_cases("video")
    assert [(c.seqlen, c.heads, c.batch, c.head_dim) for c in video] == \
        [(73_397, 7, 1, 128), (73_397, 14, 1, 128), (73_397, 56, 1, 128)]
    g = video[0].generator
    assert g["frames"] * g["height"] * g["width"] >= g["seqlen"] == 73_397
    assert [(c.seqlen, c.heads) for c in cli.preset_cases("wan480")] == [(21 * 30 * 52, 40)]
    assert [(c.seqlen, c.heads) for c in cli.preset_cases("wan720")] == [(21 * 45 * 80, 40)]
    sweep = cli.preset_cases("sweep")
    assert [c.seqlen for c in sweep] == [4096, 8192, 16384, 32768, 65536, 131072]
    assert {c.heads for c in sweep} == {7}
    for c in sweep:
        g = c.generator
        assert g["frames"] * g["height"] * g["width"] >= c.seqlen == g["seqlen"]
    smoke = cli.preset_cases("smoke")
    assert all(c.seqlen <= 2000 and c.heads <= 4 for c in smoke)
    assert set(cli.PRESETS) == {"smoke", "video", "wan480", "wan720", "sweep"}
    # Overrides.
    assert [c.heads for c in cli.preset_cases("video", heads=[3])] == [3]
    over = cli.preset_cases("smoke", seqlens=[1500])
    g = over[0].generator
    assert over[0].seqlen == 1500 and g["seqlen"] == 1500 and g["frames"] * g["height"] * g["width"] >= 1500
    with pytest.raises(ValueError):
        cli.preset_cases("nope")


def test_distinct_heads_generated_once_per_shape():
    video = cli.preset_cases("video")
    assert list(cli.distinct_heads(video, 7).values()) == [7]     # one shape, 7 heads for 7/14/56
    assert list(cli.distinct_heads(video, 0).values()) == [56]
    assert list(cli.distinct_heads(cli.preset_cases("smoke"), 7).values()) == [4]
    assert len(cli.distinct_heads(cli.preset_cases("sweep"), 7)) == 6


def test_generator_determinism_and_statistics():
    """The bench reuses video_inputs.generate: same seed same bytes, planted structure present."""
    spec = cli.preset_cases("smoke")[1]
    a = vi.generate(**spec.generator, heads=4, seed=0)
    b = vi.generate(**spec.generator, heads=4, seed=0)
    for x, y in zip((a.q, a.k, a.v), (b.q, b.k, b.v)):
        assert np.array_equal(x, y)
    c = vi.generate(**spec.generator, heads=4, seed=1)
    assert not np.array_equal(a.q, c.q)
    assert a.q.shape == (1, spec.seqlen, 4, 128)
    # qk-norm + RoPE: per-token RMS of q is 1 (up to bf16 rounding).
    rms = np.sqrt(np.mean(a.q.astype(np.float64) ** 2, axis=-1))
    assert np.allclose(rms, 1.0, atol=0.01)
    # V outliers: the planted tokens have a much larger norm than the median token.
    vn = np.linalg.norm(a.v[0], axis=-1)                          # [S, H]
    assert vn[a.v_outlier_tokens[0]].mean() > 5 * np.median(vn)
    # Tiling keeps head h equal to generated head h % distinct.
    idx = harness.head_index_map(14, 4)
    tiled = a.q[:, :, idx]
    assert np.array_equal(tiled[:, :, 9], a.q[:, :, 1])


def test_load_input_file_npz(tmp_path):
    q = np.zeros((1, 16, 2, 8), np.float32)
    path = str(tmp_path / "cap.npz")
    np.savez(path, q=q, k=q + 1, v=q + 2)
    a, b, c = cli.load_input_file(path)
    assert a.shape == (1, 16, 2, 8) and float(c[0, 0, 0, 0]) == 2.0


# ---- record schema --------------------------------------------------------------------------------------

def test_fixture_is_schema_valid(fixture_record):
    assert record.validate_record(fixture_record) == []
    assert fixture_record["schema"] == record.SCHEMA


def test_schema_catches_violations(fixture_record):
    r = copy.deepcopy(fixture_record)
    del r["environment"]["git_commit"]
    r["cases"][0]["results"][0]["scope"] = "kernel"
    r["cases"][0]["results"][1]["timing"]["median_ms"] = 1e9
    r["cases"][1]["results"][0]["status"] = "error"     # without an error message
    r["backends"]["vc"].pop("reason")
    errors = record.validate_record(r)
    joined = "\n".join(errors)
    for text in ("git_commit", "scope", "outside its samples", "needs an 'error'", "backends[vc]"):
        assert text in joined, (text, errors)
    assert record.validate_record([]) == ["record: expected a JSON object"]


def test_write_record_roundtrip(tmp_path, fixture_record):
    path = str(tmp_path / "sub" / "rec.json")
    record.write_record(fixture_record, path)
    assert record.load_record(path) == fixture_record
    assert os.listdir(tmp_path / "sub") == ["rec.json"]      # no temp file left behind


def test_other_gpu_processes():
    me, a, b = os.getpid(), {"pid": 1, "name": "x"}, {"pid": 2, "name": "y"}
    assert record.other_gpu_processes(None, False) is None          # nvidia-smi could not tell
    assert record.other_gpu_processes([], False) == []
    assert record.other_gpu_processes([a], False) == [a]             # before this process used the GPU
    assert record.other_gpu_processes([{"pid": me}, a], True) == [a]  # own PID listed
    # Host PIDs (container): the only entry is this process; two entries mean someone else is there.
    assert record.other_gpu_processes([a], True) == []
    assert record.other_gpu_processes([a, b], True) == [a, b]


def test_new_record_and_environment_without_torch():
    env = record.environment(git_commit="abc", argv=["open-vc-attn-bench", "--preset", "smoke"])
    assert env["git_commit"] == "abc" and env["command_line"] == "open-vc-attn-bench --preset smoke"
    rec = record.new_record({"rounds": 1, "seed": 0, "scopes": ["attention"], "cold_l2": False}, env)
    assert rec["status"] == "partial" and rec["cases"] == []
    assert record.validate_record(rec) == []


# ---- report ---------------------------------------------------------------------------------------------

def test_report_markdown(fixture_record):
    md = report.render_markdown([fixture_record])
    assert "NVIDIA H200 (fixture)" in md and "`0123456789ab`" in md
    assert "### video-S73397-H56" in md
    assert "| backend | scope | timing | median ms | TFLOP/s |" in md
    assert "vs cuDNN BF16" in md and "vs FA3 BF16" in md
    # open-vc at 900 vs cuDNN at 560 TF in the fixture: paired speedup ~1.61x.
    row = next(l for l in md.splitlines() if l.startswith("| open-vc | attention") and "graph" in l)
    assert "1.61x" in row
    assert "open-vc-repair ρ=0.005" in md
    assert "error: RuntimeError: no kernel image" in md                   # failed entries are shown
    assert "`fa3-bf16`" in md and "No module named 'flash_attn_interface'" in md
    assert "FP8 GEMM (torch._scaled_mm e4m3) 8192x8192x8192" in md


def test_report_files_and_plots(tmp_path, fixture_record):
    md_path, plots, msg = report.write_report([fixture_record], str(tmp_path))
    text = open(md_path).read()
    assert "NVIDIA H200 (fixture)" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plots == [] and msg == report.PLOT_SKIP_MESSAGE and msg in text
        return
    names = sorted(os.path.basename(p) for p in plots)
    assert "error_vs_repair_budget.png" in names
    assert any(n.startswith("tflops_vs_heads_S73397") for n in names)
    assert any(n.startswith("tflops_vs_seqlen_H7") for n in names)
    for p in plots:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"]({os.path.basename(p)})" in text


def test_report_cli(tmp_path, fixture_record, capsys):
    out = str(tmp_path / "rep")
    assert cli.main_report([FIXTURE, "--out-dir", out, "--no-plots"]) == 0
    assert os.path.exists(os.path.join(out, "README.md"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "nope"}))
    assert cli.main_report([str(bad), "--out-dir", out]) == 2


# ---- CLI without torch ----------------------------------------------------------------------------------

def test_bench_dry_run_does_not_import_torch():
    code = ("import sys; from open_vc_attn.bench import cli; rc = cli.main_bench(['--preset', 'video', "
            "'--dry-run']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "video-S73397-H56: B=1 S=73397 H=56 D=128" in res.stdout
    assert "distinct generated heads per shape: [7]" in res.stdout


def test_bench_rejects_unknown_backend(capsys):
    assert cli.main_bench(["--backends", "open-vc,nope", "--dry-run"]) == 2


def test_bench_help_documents_every_option_and_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")                      # one line per option: no wrapped defaults
    with pytest.raises(SystemExit) as exc:
        cli.main_bench(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "main_bench" not in out and "Entry points" not in out    # user help, not the module docstring
    lines = out.splitlines()
    for action in cli._bench_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        i = next(i for i, x in enumerate(lines) if x.startswith("  " + action.option_strings[0])
                 and x[2:].split()[0] == action.option_strings[0])
        text, below = lines[i].rstrip(), lines[i + 1].strip()
        if below and not below.startswith("-"):              # help below a long option (choices)
            text += " " + below
        assert action.help and action.help.split()[0] in text, action.dest
        if not (action.default is None or action.default is False or action.default == []):
            assert text.endswith(f"(default: {action.default})"), text


OPENVC_BACKENDS = ("open-vc", "open-vc-repair", "vc")


def _listed(out):
    """{backend: (status, reason)} from --list-backends output."""
    rows = {}
    for line in out.splitlines():
        name, rest = line.split(None, 1)
        status, _, why = rest.partition(": ")
        rows[name] = (status, why)
    return rows


def test_list_backends_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)          # makes `import torch` raise ImportError
    assert cli.main_bench(["--list-backends"]) == 0
    rows = _listed(capsys.readouterr().out)
    assert set(rows) == set(backends.BACKENDS)
    for name in OPENVC_BACKENDS:
        assert rows[name][0] == "missing" and rows[name][1].startswith("torch is not importable"), rows[name]


def test_list_backends_without_extension(tmp_path):
    """Imported from the source tree (no compiled files), openvc's backends are missing, with the fix."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    if glob.glob(os.path.join(src, "open_vc_attn", "_openvc_ext*")):
        pytest.skip("the source tree holds a compiled extension (in-place build)")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    res = subprocess.run([sys.executable, "-m", "open_vc_attn.bench.cli", "--list-backends"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = _listed(res.stdout)
    for name in OPENVC_BACKENDS:
        assert rows[name][0] == "missing" and "compiled extension" in rows[name][1] and "pip install ." in rows[name][1]


def test_openvc_backends_ok_only_where_the_kernels_run():
    try:
        import torch
        usable = torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) == (9, 0)
    except ImportError:
        usable = False
    for name in OPENVC_BACKENDS:
        status, why = backends.available(name)
        assert (status == "ok") is usable and (why is None) is usable, (name, status, why)


# ---- torch parts (CPU torch is enough) ------------------------------------------------------------------

def test_exact_attention_and_metrics_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 37, 3, 16)).astype(np.float32) for _ in range(3))
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhqk,bkhd->bqhd", p, v.astype(np.float64))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    # A tiny budget forces many row chunks (the chunking must not change the result).
    out = harness.exact_attention_fp32(tq, tk, tv, mem_budget_bytes=3 * 37 * 4 * 5)
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 37, 3, 16)
    assert np.allclose(out.numpy(), ref, atol=1e-5)
    m = harness.error_metrics_torch(out, torch.from_numpy(ref), chunk_elems=100)
    assert m["rel_l2"] < 1e-5 and m["cosine"] == pytest.approx(1.0)
    noisy = out + 0.01
    m = harness.error_metrics_torch(noisy, out)
    assert m["max_abs"] == pytest.approx(0.01, rel=1e-3) and m["rmse"] == pytest.approx(0.01, rel=1e-3)


@pytest.mark.gpu
def test_bench_smoke_end_to_end(tmp_path):
    out = str(tmp_path / "smoke.json")
    rc = cli.main_bench(["--preset", "smoke", "--rounds", "2", "--target-ms", "2", "--out", out,
                         "--allow-shared", "--no-ceilings"])
    assert rc == 0
    rec = record.load_record(out)
    assert record.validate_record(rec) == []
    assert rec["status"] == "complete" and len(rec["cases"]) == 2
    ok = {r["id"] for r in rec["cases"][0]["results"] if r["status"] == "ok"}
    assert "sdpa-cudnn:attention" in ok or "sdpa-flash:attention" in ok
    md, _, _ = report.write_report([rec], str(tmp_path / "report"))
    assert os.path.exists(md)


@pytest.mark.gpu
def test_one_function_timers_agree(torch):
    """median_ms (graph replay, as the benchmark), eager_ms and PhaseTimer (the examples' and device
    scripts' timers) measure the same work alike."""
    x = torch.randn(4096, 4096, device="cuda")

    def f():
        return x @ x

    graphed, eager = harness.median_ms(f, rounds=3), harness.eager_ms(f, 5)
    assert graphed > 0 and eager > 0 and 0.5 < graphed / eager < 2
    timer = harness.PhaseTimer()
    for _ in range(2):
        with timer("matmul"):
            f()
    totals = timer.totals_ms()
    assert set(totals) == {"matmul"} and 0.5 < totals["matmul"] / (2 * eager) < 2
