"""scripts/device/dispatch_floor.py: the crossover and threshold logic against hand-worked grids (no torch),
and the whole script's --dry-run on the CPU (torch; SDPA stands in for openvc)."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "device" / "dispatch_floor.py"


@pytest.fixture(scope="module")
def df():
    spec = importlib.util.spec_from_file_location("dispatch_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(sq, sk, speedup, heads=12):
    return {"heads": heads, "sq": sq, "sk": sk, "speedup": {"sdpa": speedup}}


def test_stable_from(df):
    assert df.stable_from([(256, 0.2), (1024, 1.1), (4096, 0.9), (16384, 1.3), (65536, 1.5)]) == 16384
    assert df.stable_from([(256, 1.2), (1024, 1.1)]) == 256
    assert df.stable_from([(256, 1.2), (1024, 0.9)]) is None          # the largest size loses
    assert df.stable_from([(256, 1.2), (1024, None)]) is None


def test_crossovers_and_policy_rectangles(df):
    # wins (speedup > 1) where Sq >= 4096 and Sk >= 1024, and on the diagonal from 4096; 12 and 24 heads
    # alike except (4096, 1024) at 24 heads, which loses: the rectangle then needs Sk >= 4096 or Sq >= 16384
    sizes = (1024, 4096, 16384)
    rows = []
    for h in (12, 24):
        for sq in sizes:
            for sk in sizes:
                win = sq >= 4096 and sk >= 1024 and not (h == 24 and (sq, sk) == (4096, 1024))
                rows.append(row(sq, sk, 1.5 if win else 0.5, h))
    cross = df.crossovers(rows)
    assert cross[12] == {"self_from": 4096, "cross_keys_from": {1024: None, 4096: 1024, 16384: 1024},
                         "cross_queries_from": {1024: 4096, 4096: 4096, 16384: 4096}}
    assert cross[24]["cross_keys_from"][4096] == 4096 and cross[24]["cross_queries_from"][1024] == 16384
    rects = df.policy_rectangles(rows)
    pairs = [(r["min_query_tokens"], r["min_key_tokens"]) for r in rects]
    assert sorted(pairs) == [(4096, 4096), (16384, 1024)]
    total = 2 * sum(q * k for q in sizes for k in sizes)
    share = {p: r["work_share"] for p, r in zip(pairs, rects)}
    assert share[(4096, 4096)] == pytest.approx(2 * (4096 + 16384) ** 2 / total)
    assert share[(16384, 1024)] == pytest.approx(2 * 16384 * (1024 + 4096 + 16384) / total)
    assert pairs[0] == max(share, key=share.get)                      # sorted by the work sent to openvc
    assert df.policy_rectangles([row(1024, 1024, 0.5)]) == []


def test_paired_speedup(df):
    assert df.paired_speedup([2.0, 4.0, 3.0], [1.0, 1.0, 3.0]) == 2.0    # median of 2, 4, 1
    assert df.paired_speedup([], []) is None


def test_dry_run(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "floor.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["dry_run"] and len(data["grid"]) == 9 and not data["skipped"]
    assert {"openvc", "sdpa"} <= set(data["floor"][0]["us_per_call"])
    assert all(set(r["speedup"]) == {"sdpa"} for r in data["grid"])
    assert "openvc" in data["profile"] and "crossover vs sdpa H=2" in res.stdout
