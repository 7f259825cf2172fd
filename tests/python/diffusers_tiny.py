"""Tiny diffusers video transformers under open_vc_attn.integrations.diffusers.apply on the CPU: the helpers the
model tests share (test_integrations_diffusers_models.py and the files beside it; the recording stand-in of
openvc's fast path is conftest.py's ``stand_in`` fixture)."""
import warnings

import pytest

STAND_IN_REL_L2 = 0.02      # FP32 SDPA rounded to BF16 against diffusers' BF16 SDPA, through a few blocks


def forward(torch, model, inputs):
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_three_ways(torch, ovd, model, inputs, pol):
    """(reference, openvc output, stats(model)); checks that remove() restores the model bit for bit."""
    ref = forward(torch, model, inputs)
    originals = [m.processor for m in model.modules() if hasattr(m, "processor")]
    out = applied_forward(torch, ovd, model, inputs, pol)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == originals
    assert torch.equal(forward(torch, model, inputs), ref)
    return ref, out, ovd.stats(model)


def applied_forward(torch, ovd, model, inputs, pol):
    """One forward under apply(model, policy=pol) (stats reset first, fallback warnings silenced), then remove()."""
    ovd.apply(model, policy=pol)
    ovd.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ovd.FallbackWarning)
            return forward(torch, model, inputs)
    finally:
        ovd.remove(model)


def small_policy(policy, n):
    return policy.DispatchPolicy(min_query_tokens=n, min_key_tokens=n)


def gen(torch, seed=None):
    return torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()) if seed is None else seed))


def randn(torch, g, *shape):
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def build(torch, cls_name, **cfg):
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")   # tests without ovd too
    torch.manual_seed(int(torch.randint(0, 2 ** 31, ())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(diffusers, cls_name)(**cfg).to(torch.bfloat16).eval()
