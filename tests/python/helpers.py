"""Input builders shared by the Python tests (imported as `helpers`: pytest puts this folder on sys.path).
The `torch` fixture is in conftest.py."""
import contextlib
import warnings

import numpy as np

from open_vc_attn import video_inputs


def video_qkv(b, s, h, dtype="bfloat16", seed=0, d=128, sinks=True):
    """Synthetic video-like numpy q, k, v [B, S, H, D] (float32 holding bf16 values, or float16), with sink
    keys (unless sinks=False) and V outliers; fewer than 16 tokens get neither (too few for them)."""
    small = s < 16
    p = video_inputs.generate(frames=max(1, -(-s // 128)), height=8, width=16, seqlen=s, batch=b, heads=h,
                              head_dim=d, seed=seed, dtype=dtype, num_sink_tokens=0 if small or not sinks else 4,
                              v_outlier_fraction=0.0 if small else 0.001)
    return p.q, p.k, p.v


def to_cuda(torch, arrays, dtype="bfloat16", device="cuda"):
    """numpy arrays -> torch tensors of `dtype` on `device` (exact: the values already are bf16 / fp16)."""
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device, tdt) for x in arrays)


def torch_qkv(torch, b, s, h, dtype="bfloat16", seed=0, device="cuda"):
    """video_qkv as torch tensors on `device`."""
    return to_cuda(torch, video_qkv(b, s, h, dtype, seed), dtype, device)


def cpu_qkv(torch, shape=(1, 8, 2, 128), dtype=None, **over):
    """Zero CPU q, k, v of `shape` (bfloat16 unless dtype), any of them replaced by keyword (q=..., k=...):
    for the argument checks, which run before the device check."""
    dtype = dtype or torch.bfloat16
    t = {n: torch.zeros(shape, dtype=dtype) for n in "qkv"}
    t.update(over)
    return t["q"], t["k"], t["v"]


def bytes_equal(torch, a, b):
    """Same shape, dtype and bytes (NaN payloads and -0.0 included)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def graph_replays_like_eager(torch, call, inputs, *new_inputs):
    """Captures ``call(*inputs)`` in a CUDA graph in *global* capture mode, then replays it with each of
    ``new_inputs`` (and ``inputs`` again) copied into the captured tensors and compares every output, byte
    for byte, with an eager ``call`` on the same values.

    Global mode is what makes this a host-synchronization check that sees inside libopenvc: while a
    global-mode capture is under way, the CUDA driver refuses synchronizing and other unsafe calls
    (cudaStreamSynchronize, cudaDeviceSynchronize, a synchronous cudaMemcpy, cudaMalloc, ...) from any
    caller in the process, whatever CUDA runtime made them, and invalidates the capture, so the call or
    the end of the capture raises. torch.cuda.set_sync_debug_mode("error") sees torch's own calls only,
    and libopenvc links its CUDA runtime statically.

    call: returns a tensor or a tuple of tensors (return a preparation's ``.tensors()``, not the object).
    inputs, new_inputs: tuples of CUDA tensors of one shape and dtype each (q, k, v, offsets, key counts).
    """
    static = tuple(x.clone() for x in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up outside the capture: extension and op loading, first launches
        call(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        captured = call(*static)
    captured = captured if isinstance(captured, tuple) else (captured,)
    for new in (*new_inputs, inputs):
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = call(*new)
        want = want if isinstance(want, tuple) else (want,)
        assert len(captured) == len(want)
        for i, (got, expected) in enumerate(zip(captured, want)):
            assert bytes_equal(torch, got, expected), f"output {i} of the replay differs from the eager call"


def wan22_pipeline(torch, fallback_warnings_are_errors=False):
    """(pipe, run): diffusers' WanPipeline with two random 1-layer Wan transformers (2 heads of 128) and Wan2.2
    A14B's boundary: the first step (t = 1000) runs `transformer`, the second (t = 833) `transformer_2`, guidance
    as two forwards per step. No text encoder, VAE or weights are loaded: prompt embeddings are given and run()
    returns the latents. fallback_warnings_are_errors: run() turns the integration's FallbackWarning (a forward
    with no openvc call) into an error."""
    import pytest
    pytest.importorskip("transformers", reason="diffusers' WanPipeline needs transformers")
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    def transformer(seed):
        torch.manual_seed(seed)
        return WanTransformer3DModel(num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
                                     text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
                                     rope_max_seq_len=64).to(torch.bfloat16).eval()

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer(0),
                       transformer_2=transformer(1), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                       boundary_ratio=0.875)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    text = [torch.randn(1, 16, 32, generator=g).to(torch.bfloat16) for _ in range(2)]

    def run():
        guard = warnings.catch_warnings() if fallback_warnings_are_errors else contextlib.nullcontext()
        with torch.inference_mode(), guard:   # 5 frames of 128 x 128: a 2 x 16 x 16 latent, 128 video tokens
            if fallback_warnings_are_errors:
                from open_vc_attn.integrations.diffusers import FallbackWarning
                warnings.simplefilter("error", FallbackWarning)
            return pipe(prompt_embeds=text[0], negative_prompt_embeds=text[1], height=128, width=128, num_frames=5,
                        num_inference_steps=2, guidance_scale=2.0, output_type="latent",
                        generator=torch.Generator().manual_seed(0)).frames
    return pipe, run
