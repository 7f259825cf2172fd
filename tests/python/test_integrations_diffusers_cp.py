"""diffusers context parallelism with the openvc backend (open_vc_attn.integrations.diffusers, _diffusers_cp).

Two CPU processes (gloo) run a small random Wan transformer with ``enable_parallelism`` (diffusers' own
Ulysses all-to-all or ring loop, degree 2) and the openvc backend applied, openvc's fast path replaced by
exact attention with its LSE (the device check bypassed). Each rank's output is compared with the same
model run in one process without parallelism, and the routing counts show where each local call went:
openvc (every ring step), or, with thresholds no call meets, the fallback (native SDPA under Ulysses,
exact attention with LSE in the ring). With apply(model, block_mask=frame-causal mask), Ulysses' local calls
(the whole sequence, half the heads) are block-sparse, the stand-in attending the mask's blocks. Skips
without torch or diffusers. This file, run as a script, is those workers.
"""
import json
import pathlib
import subprocess
import sys

import pytest

from two_process import finish_rank, free_port, route_counts

HERE = pathlib.Path(__file__).resolve()


@pytest.mark.parametrize("ulysses,ring,route,order", [
    (2, 1, "openvc", "apply-then-enable"),
    (1, 2, "openvc", "enable-then-apply"),
    (1, 2, "fallback", "apply-then-enable"),
    (2, 1, "block_mask", "apply-then-enable"),
], ids=["ulysses2-openvc", "ring2-openvc", "ring2-fallback", "ulysses2-block-mask"])
def test_context_parallel_two_processes(tmp_path, ulysses, ring, route, order):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE), str(ulysses), str(ring), route, order, str(free_port()), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    ranks = json.loads(out.read_text())["ranks"]
    for r in ranks:
        assert r["cp_backend"], r            # diffusers lists openvc among its context-parallel backends
        assert r["rel_l2"] < 1e-2, r          # vs the single-process forward (BF16 activations)
        paths = {}
        for key, n in r["routes"].items():
            paths[key.split(":")[0]] = paths.get(key.split(":")[0], 0) + n
        # self-attention: one local call per ring step (Ulysses: one); text cross-attention: one, unparallel
        if route == "openvc":
            assert paths == {"openvc": ring, "fallback": 1}, r
        elif route == "block_mask":
            assert paths == {"openvc-block-sparse": 1, "fallback": 1}, r
        else:
            assert paths == {"fallback": ring + 1}, r


def _worker(rank, world, ulysses, ring, route, order, port, out_path):
    import copy
    import logging
    import os

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if torch.accelerator.device_count() == 0:
        # diffusers 0.42.1 computes its device as rank % accelerator count (0 here); the device is only recorded
        torch.accelerator.device_count = lambda: 1
    if not hasattr(logging.Logger, "warning_once"):
        # diffusers' context-parallel hooks call logger.warning_once, which transformers adds to Logger
        logging.Logger.warning_once = logging.Logger.warning
    from diffusers import ContextParallelConfig, WanTransformer3DModel
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    from open_vc_attn.integrations import _exact, policy
    from open_vc_attn.integrations import diffusers as ovd
    policy._device_reason = lambda device: None

    def fast(q, k, v, scale, return_lse=False, block_mask=None, **fmt):
        keep = None
        if block_mask is not None:   # the listed blocks, whole (here one 128-token block: the routes show the mask)
            keep = block_mask.to_dense()[0, 0].bool().repeat_interleave(128, 0).repeat_interleave(128, 1)
            keep = keep[None, None, :q.shape[1], :k.shape[1]]
        res = _exact.attention_with_lse(q, k, v, scale=scale, attn_mask=keep)
        return res if return_lse else res[0]

    ovd._fast_attention = fast
    thresholds = policy.DispatchPolicy(min_query_tokens=100000, min_key_tokens=1) if route == "fallback" else \
        policy.DispatchPolicy(min_query_tokens=64, min_key_tokens=64)
    mask = None
    if route == "block_mask":
        from open_vc_attn import masks
        mask = masks.frame_causal(2, 64, device="cpu")      # the 2 latent frames of 8 x 8 tokens below

    torch.manual_seed(0)
    model = WanTransformer3DModel(num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
                                  rope_max_seq_len=64).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g).to(torch.bfloat16),    # 128 tokens
                  timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 16, 32, generator=g).to(
                      torch.bfloat16), return_dict=False)
    parallel = copy.deepcopy(model)
    ovd.apply(model, policy=thresholds, block_mask=mask)
    with torch.inference_mode():
        ref = model(**inputs)[0]

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh)
    if order == "apply-then-enable":
        ovd.apply(parallel, policy=thresholds, block_mask=mask)
        parallel.enable_parallelism(config=config)
    else:
        parallel.enable_parallelism(config=config)
        ovd.apply(parallel, policy=thresholds, block_mask=mask)
    ovd.reset_stats()
    with torch.inference_mode():
        out = parallel(**inputs)[0]
    routes = route_counts(ovd.stats())
    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
    result = {"rank": rank, "rel_l2": rel, "routes": routes,
              "cp_backend": _AttentionBackendRegistry._is_context_parallel_available(ovd.register())}
    finish_rank(dist, rank, world, result, out_path)


if __name__ == "__main__":
    import torch.multiprocessing as mp
    u, r = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(_worker, args=(u * r, u, r, *sys.argv[3:5], int(sys.argv[5]), sys.argv[6]), nprocs=u * r)
