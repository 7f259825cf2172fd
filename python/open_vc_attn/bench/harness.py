"""Timing and accuracy machinery of the benchmark (torch imported inside the functions that need it).

Method (docs: what every number in a record means):
- Each backend call is captured in a CUDA graph of R back-to-back calls, R chosen so that one replay
  lasts >= target_ms (20 ms): launch gaps and Python overhead then vanish from the per-call time. A
  backend whose capture fails is timed eagerly (R calls between two CUDA events) and marked "eager".
- Rounds: every round visits all entries of a case once, in an order drawn from a seeded RNG, one
  timed replay each; per-call time = replay time / R. Clock drift and thermal state then hit all
  entries alike, and a speedup is the median over rounds of the per-round ratio (paired), which
  cancels what the round shares.
- Cold L2 (optional, only when the inputs fit in L2): R single-call replays per sample, each after a
  256 MB write that evicts L2, with only the call between the events.
- Accuracy: every output against exact attention computed in FP32 on the GPU (IEEE FP32 matmuls, TF32
  off), chunked over query rows, and against the BF16 SDPA output; metrics of numerics.md section 8.
"""
from __future__ import annotations

import collections
import contextlib
import math
import random
import statistics

FLUSH_BYTES = 256 << 20


class Eager:
    """A bench.modes entry timed eagerly (CUDA events around R back-to-back calls), never captured in a CUDA
    graph (bench.modes and bench.sparse mark peers that must not be captured with it)."""

    def __init__(self, fn):
        self.fn = fn


# ---- pure math (no torch; unit-tested on CPU) -----------------------------------------------------------

def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> int:
    """Non-causal forward FLOPs: two GEMMs (QK^T and PV) of 2*Sq*Sk*D each per (batch, head)."""
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def visiting_orders(ids, rounds: int, seed: int) -> list:
    """One shuffled copy of ids per round, from random.Random(seed): the same seed gives the same
    orders on every machine and Python version (Random's int seeding and shuffle are stable)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(ids)
        rng.shuffle(order)
        orders.append(order)
    return orders


def paired_ratios(anchor_ms, this_ms) -> dict:
    """Speedup of 'this' over an anchor, paired per round: per_round[r] = anchor[r] / this[r] (> 1: this
    is faster); median over the rounds where both have a sample."""
    per_round = [a / t for a, t in zip(anchor_ms, this_ms)
                 if a is not None and t is not None and a > 0 and t > 0]
    return {"median": median(per_round), "per_round": per_round}


def calls_per_replay(call_ms: float, target_ms: float = 20.0, max_calls: int = 4096) -> int:
    """R so that R calls last at least target_ms (at least 1, at most max_calls)."""
    if not call_ms or call_ms <= 0 or math.isnan(call_ms):
        return max_calls
    return int(min(max_calls, max(1, math.ceil(target_ms / call_ms))))


def finalize_metrics(sum_sq_diff, sum_sq_ref, sum_sq_out, dot, max_abs, count) -> dict:
    """Section 8 metrics from partial sums accumulated in float64 over chunks."""
    if count == 0:
        return {"rel_l2": float("nan"), "rmse": float("nan"), "max_abs": float("nan"), "cosine": float("nan")}
    ref_norm, out_norm = math.sqrt(sum_sq_ref), math.sqrt(sum_sq_out)
    return {"rel_l2": math.sqrt(sum_sq_diff) / ref_norm if ref_norm > 0 else float("inf"),
            "rmse": math.sqrt(sum_sq_diff / count),
            "max_abs": float(max_abs),
            "cosine": dot / (out_norm * ref_norm) if out_norm > 0 and ref_norm > 0 else float("nan")}


def head_index_map(heads: int, distinct: int) -> list:
    """Generated head feeding each of `heads` output heads when only `distinct` heads are generated:
    head h is a copy of generated head h % distinct (tiling along the head axis)."""
    if heads < 1 or distinct < 1:
        raise ValueError("heads, distinct: expected ints >= 1")
    return [h % distinct for h in range(heads)]


# ---- torch helpers --------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def input_bytes(q, k, v) -> int:
    """Bytes a call reads and writes at least: q, k, v and an output shaped like q."""
    return sum(x.numel() * x.element_size() for x in (q, k, v)) + q.numel() * q.element_size()


def eager_ms(fn, calls=1) -> float:
    """Milliseconds per call of exactly `calls` back-to-back eager calls between two CUDA events on the
    current stream (exact call counts: safe with collectives, where every rank must call alike)."""
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def median_ms(fn, rounds=10, *, use_graph=True, target_ms=20.0) -> float:
    """Milliseconds per call of fn, measured as the benchmark does (a warmed-up :class:`Timer`: a CUDA graph
    of R calls lasting >= target_ms, or eager when capture fails or use_graph is False): the median of
    `rounds` samples. For examples and device scripts that time one function."""
    timer = Timer(fn, target_ms=target_ms, use_graph=use_graph)
    try:
        return median([timer.sample() for _ in range(rounds)])
    finally:
        timer.release()


class PhaseTimer:
    """``with timer(name): ...`` records a CUDA event pair around the block on the current stream;
    :meth:`totals_ms` syncs and sums each name's pairs. For phase breakdowns of one call (the phases
    enqueue asynchronously, so the events, not the host clock, measure them)."""

    def __init__(self):
        self.pairs = collections.defaultdict(list)

    def __call__(self, name):
        torch = _torch()

        @contextlib.contextmanager
        def phase():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.pairs[name].append((start, end))
        return phase()

    def totals_ms(self) -> dict:
        _torch().cuda.synchronize()
        return {name: sum(s.elapsed_time(e) for s, e in pairs) for name, pairs in self.pairs.items()}


class L2Flusher:
    """Writes a 256 MB buffer (5x the H200's 50 MB L2) so that the next call starts with a cold L2."""

    def __init__(self, device):
        torch = _torch()
        self.buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def __call__(self):
        self.buf.fill_(0)


class Timer:
    """One backend call prepared for timing: warmed up, captured in a CUDA graph of R calls (or eager)."""

    def __init__(self, fn, *, target_ms=20.0, max_calls=4096, use_graph=True, cold=False):
        torch = _torch()
        self.fn, self.cold = fn, cold
        self.capture_error = None
        # Warm-up on a side stream, as CUDA graph capture requires (lazy init, cuBLAS/cuDNN plans, JIT).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        est = self._eager_ms(1)
        if est < 1.0:   # short calls: a better estimate is cheap
            est = self._eager_ms(max(2, min(50, int(5.0 / max(est, 1e-3)))))
        self.call_ms_estimate = est
        reps = calls_per_replay(est, target_ms, max_calls)
        # Cold L2: one call per replay (only the first call of a replay would be cold), R replays.
        self.calls, self.cold_reps = (1, reps) if cold else (reps, 1)
        self.graph = None
        if use_graph:
            self.graph = self._capture()
            if self.graph is not None and not cold:
                # Eager estimates of short calls include launch overhead: size R again from a replay.
                per_call = self.sample()
                better = calls_per_replay(per_call, target_ms, max_calls)
                if better > 1.5 * self.calls:
                    self.graph, self.calls = None, better
                    self.graph = self._capture()
        self.method = "cuda_graph" if self.graph is not None else "eager"
        for _ in range(2):   # warm replays
            self._launch()
        torch.cuda.synchronize()

    def _eager_ms(self, n):
        return eager_ms(self.fn, n)

    def _capture(self):
        torch = _torch()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                for _ in range(self.calls):
                    self.fn()
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            return graph
        except Exception as exc:   # a backend that syncs, allocates on host, or is not capture-safe
            self.capture_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            del graph
            # torch.cuda.graph's __exit__ skips restoring the stream when capture_end raises.
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize()
            return None

    def _launch(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.calls):
                self.fn()

    def sample(self, flush=None) -> float:
        """Milliseconds per call from one timed replay (cold: mean of cold_reps flushed replays)."""
        torch = _torch()
        if not self.cold:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._launch()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / self.calls
        pairs = []
        for _ in range(self.cold_reps):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._launch()
            end.record()
            pairs.append((start, end))
        pairs[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in pairs) / (len(pairs) * self.calls)

    def describe(self) -> dict:
        d = {"method": self.method, "calls_per_replay": self.calls, "cold_reps": self.cold_reps,
             "call_ms_estimate": self.call_ms_estimate}
        if self.capture_error:
            d["capture_error"] = self.capture_error
        return d

    def release(self):
        self.graph = None
        self.fn = None


def run_rounds(timers: dict, rounds: int, seed: int, flush=None, warm_round=True) -> tuple:
    """Times every timer once per round in a seeded random order. Returns ({id: [ms per round]},
    orders). A timer that fails mid-run gets None samples from then on (and its error in errors)."""
    ids = list(timers)
    samples = {i: [] for i in ids}
    errors = {}
    if warm_round:   # untimed pass: clocks up, every graph's memory touched once
        for i in ids:
            try:
                timers[i].sample(flush)
            except Exception as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
    orders = visiting_orders(ids, rounds, seed)
    for order in orders:
        for i in order:
            if i in errors:
                samples[i].append(None)
                continue
            try:
                samples[i].append(timers[i].sample(flush))
            except Exception as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
                samples[i].append(None)
    return samples, orders, errors


# ---- accuracy -------------------------------------------------------------------------------------------

class _ExactFP32:
    """Context: IEEE FP32 matmuls (precision "highest": no TF32), restoring the previous setting after.
    One switch only (cuBLAS's allow_tf32 follows it), so as not to mix torch's old and new TF32 APIs."""

    def __enter__(self):
        torch = _torch()
        self.prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc):
        _torch().set_float32_matmul_precision(self.prev)


def exact_attention_fp32(q, k, v, softmax_scale=None, mem_budget_bytes=4 << 30):
    """softmax(q k^T * scale) v in FP32 for [B, S, H, D] tensors (any float dtype, any device); returns
    float32 [B, Sq, H, D]. Query rows go in chunks so that the [H, rows, Sk] score block stays within
    mem_budget_bytes (one buffer, exponentiated in place)."""
    torch = _torch()
    b_, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = torch.empty((b_, sq, h, d), dtype=torch.float32, device=q.device)
    rows = max(1, int(mem_budget_bytes // (h * sk * 4)))
    with _ExactFP32(), torch.no_grad():
        for b in range(b_):
            kt = k[b].float().permute(1, 2, 0)       # [H, D, Sk]
            vb = v[b].float().transpose(0, 1)        # [H, Sk, D]
            for r0 in range(0, sq, rows):
                r1 = min(sq, r0 + rows)
                s = torch.matmul(q[b, r0:r1].float().transpose(0, 1), kt)   # [H, rows, Sk]
                s.mul_(scale)
                s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
                denom = s.sum(dim=-1, keepdim=True)
                o = torch.matmul(s, vb).div_(denom)  # [H, rows, D]
                out[b, r0:r1] = o.transpose(0, 1)
                del s, o
    return out


def error_metrics_torch(out, ref, chunk_elems=1 << 26) -> dict:
    """Section 8 metrics of out against ref (same shape, any float dtypes), float64 accumulation over
    chunks of rows (bounded extra memory)."""
    torch = _torch()
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: expected the shape of ref {tuple(ref.shape)}, got {tuple(out.shape)}")
    o2 = out.reshape(-1, out.shape[-1])
    r2 = ref.reshape(-1, ref.shape[-1])
    rows = max(1, chunk_elems // max(1, o2.shape[1]))
    acc = torch.zeros(4, dtype=torch.float64, device=out.device)
    max_abs = torch.zeros((), dtype=torch.float64, device=out.device)
    with torch.no_grad():
        for r0 in range(0, o2.shape[0], rows):
            o = o2[r0:r0 + rows].double()
            r = r2[r0:r0 + rows].double()
            diff = o - r
            acc += torch.stack([(diff * diff).sum(), (r * r).sum(), (o * o).sum(), (o * r).sum()])
            max_abs = torch.maximum(max_abs, diff.abs().max())
    a = acc.tolist()
    return finalize_metrics(a[0], a[1], a[2], a[3], float(max_abs), o2.numel())
