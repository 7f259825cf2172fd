"""open_vc_attn.ops.oneshot: eager fast-path calls of api.attention with the FP8 intermediates in one scratch
allocation. The layout is checked on the CPU; on the GPU the one-shot call gives the bits of the two-step
path (prepare_fp8 then the attention op) in every mode it takes, and replays in a CUDA graph."""
import pytest

torch = pytest.importorskip("torch")
oneshot = pytest.importorskip("open_vc_attn.ops.oneshot")
from open_vc_attn._layout import fp8_expectations  # noqa: E402


@pytest.mark.parametrize("fmt", [("e4m3", False), ("int8", False), ("int8", True), ("e4m3", True)])
@pytest.mark.parametrize("b, sq, sk, h, d", [(1, 256, 256, 12, 128), (2, 1000, 77, 3, 64), (1, 1, 1, 1, 128)])
def test_layout_slices_are_aligned_and_disjoint(b, sq, sk, h, d, fmt):
    shapes, offsets, ws_bytes, total = oneshot._layout(b, sq, sk, h, d, *fmt)
    exp = fp8_expectations(b, sq, sk, h, d, fmt[0])   # INT8: q_descale [B, H, Sq], k_descale [B, H, nk, 8]
    assert shapes == tuple(shape for _, shape, _ in exp)
    ends = []
    for (_, shape, dtype), off in zip(exp, offsets):
        n = torch.Size(shape).numel() * (4 if dtype == "float32" else 1)
        ends.append(off + n)
    ends.append(offsets[6] + ws_bytes)
    assert all(off % 256 == 0 for off in offsets)
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))   # in order, no overlap
    assert ends[-1] <= total and ws_bytes >= 16


def _two_step(ova, q, k, v, **kw):
    """The same call through the ops (prepare_fp8, then attention_fp8 or attention_fp8_full)."""
    from open_vc_attn import api
    from open_vc_attn.ops import direct
    seqused = kw.get("seqused_k")
    prepared = direct.prepare_fp8(q, k, v, seqused)
    return api._run_attention(prepared, 4, kw.get("softmax_scale", q.shape[-1] ** -0.5), 4, True,
                              kw.get("causal", False), seqused_k=seqused, out_dtype=kw.get("out_dtype"))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_oneshot_equals_the_two_step_path(d):
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 700, 3, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 900, 3, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    counts = torch.tensor([900, 333], dtype=torch.int32, device="cuda")
    for kw in ({}, {"causal": True}, {"seqused_k": counts}, {"out_dtype": torch.float16}):
        out, lse = ova.attention(q, k, v, return_lse=True, **kw)
        ref_out, ref_lse = _two_step(ova, q, k, v, **kw)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), kw
    # rank 3: one sequence, the batch axis dropped
    out3 = ova.attention(q[0], k[0], v[0])
    assert out3.shape == q[0].shape and torch.equal(out3, ova.attention(q[:1], k[:1], v[:1])[0])


@pytest.mark.gpu
def test_gpu_oneshot_replays_in_a_cuda_graph_with_new_inputs():
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 1000, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    ova.attention(q, k, v)   # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ova.attention(q, k, v, causal=True)
    for seed in (11, 12):
        g.manual_seed(seed)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ova.attention(q, k, v, causal=True))
