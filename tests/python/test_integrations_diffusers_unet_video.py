"""The UNet-era video models of diffusers 0.42.1 (TransformerTemporalModel, UNet3DConditionModel,
UNetSpatioTemporalConditionModel), tiny on the CPU (the UNets in FP32: BF16 convolutions are slow there), under
open_vc_attn.integrations.diffusers.apply: their attention modules use diffusers' generic processors
(AttnProcessor2_0, and the fused or default variants a user can switch to), which call torch SDPA themselves and
have no openvc replacement, so apply raises a ValueError naming the processor classes and leaves the model as it
was (same processors, no hook, no stats, the same output bit for bit, no call reaching openvc's fast path).
ConsisID is tested in test_integrations_diffusers_models.py."""
import re

import pytest

from diffusers_tiny import build, forward, gen, randn


def transformer_temporal(torch):
    """One BasicTransformerBlock (two self-attentions over frames), 2 heads of 8; 2 videos of 3 frames, 4 x 4."""
    model = build(torch, "TransformerTemporalModel", num_attention_heads=2, attention_head_dim=8, in_channels=16,
                  norm_num_groups=4, num_layers=1)
    return model, dict(hidden_states=randn(torch, gen(torch), 2 * 3, 16, 4, 4), num_frames=3)


def fp32(torch, model, inputs):
    return model.float(), {k: v.float() if torch.is_tensor(v) else v for k, v in inputs.items()}


def unet_3d(torch):
    """ModelScope-style UNet3D, FP32: two levels (4, 8 channels), heads of 2 (transformer_in: 8 heads of 2);
    2 frames, 4 x 4, text 3 tokens of 8."""
    model = build(torch, "UNet3DConditionModel", block_out_channels=(4, 8), norm_num_groups=4,
                  down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                  up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=8, attention_head_dim=2,
                  in_channels=4, out_channels=4, layers_per_block=1, sample_size=8)
    g = gen(torch)
    return fp32(torch, model, dict(sample=randn(torch, g, 1, 4, 2, 4, 4), timestep=torch.tensor([10]),
                                   encoder_hidden_states=randn(torch, g, 1, 3, 8)))


def unet_svd(torch):
    """Stable Video Diffusion's UNet, FP32: two levels of 32 channels (its GroupNorms have 32 groups), 2 heads of
    16; 2 frames, 4 x 4, one image token of 16."""
    model = build(torch, "UNetSpatioTemporalConditionModel", block_out_channels=(32, 32),
                  down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                  up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
                  cross_attention_dim=16, num_attention_heads=(2, 2), in_channels=4, out_channels=4,
                  layers_per_block=1, sample_size=8, projection_class_embeddings_input_dim=3 * 8,
                  addition_time_embed_dim=8, num_frames=2)
    g = gen(torch)
    return fp32(torch, model, dict(sample=randn(torch, g, 1, 2, 4, 4, 4), timestep=torch.tensor([10.0]),
                                   encoder_hidden_states=randn(torch, g, 1, 1, 16),
                                   added_time_ids=torch.tensor([[6.0, 127.0, 0.02]])))


MODELS = {"TransformerTemporalModel": (transformer_temporal, 2),
          "UNet3DConditionModel": (unet_3d, 18),
          "UNetSpatioTemporalConditionModel": (unet_svd, 16)}


def no_route(cls, procs):
    """The start of apply's error for a model whose processors (class names) call torch SDPA themselves."""
    return (f"^model: {cls}'s attention processors \\({procs}\\) compute attention themselves "
            + re.escape("(torch.nn.functional.scaled_dot_product_attention) instead of calling diffusers' "
                        "dispatch_attention_fn, so no diffusers attention backend, openvc included, sees their "
                        "calls, and openvc has no replacement for them"))


def processor_objects(model):
    return [(name, m.processor) for name, m in model.named_modules() if hasattr(m, "processor")]


def assert_apply_refused(torch, ovd, model, inputs, stand_in, procs):
    """apply(model) raises the no-route error and installs nothing: the model runs as before."""
    cls = type(model).__name__
    ref = forward(torch, model, inputs)
    before = processor_objects(model)
    with pytest.raises(ValueError, match=no_route(cls, procs)):
        ovd.apply(model)
    after = processor_objects(model)
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    assert not model._forward_hooks and not model._forward_pre_hooks
    with pytest.raises(ValueError, match=f"^model: {cls} was never wrapped by apply\\(\\)"):
        ovd.stats(model)
    assert torch.equal(forward(torch, model, inputs), ref)
    assert stand_in == []      # openvc's fast path (made to take CPU calls) saw none


@pytest.mark.parametrize("cls", list(MODELS))
def test_generic_processors_are_refused(torch, ovd, stand_in, cls):
    make, count = MODELS[cls]
    model, inputs = make(torch)
    procs = [type(p) for _, p in processor_objects(model)]
    assert len(procs) == count
    assert {(p.__module__, p.__name__) for p in procs} == {("diffusers.models.attention_processor",
                                                           "AttnProcessor2_0")}
    assert not hasattr(procs[0](), "_attention_backend")    # not one of diffusers' dispatch processors
    assert_apply_refused(torch, ovd, model, inputs, stand_in, "AttnProcessor2_0")


def test_unet_3d_fused_qkv_is_refused(torch, ovd, stand_in):
    """fuse_qkv_projections (UNet3D's) switches to FusedAttnProcessor2_0: torch SDPA too, refused the same way."""
    model, inputs = unet_3d(torch)
    model.fuse_qkv_projections()
    assert {type(p).__name__ for _, p in processor_objects(model)} == {"FusedAttnProcessor2_0"}
    assert_apply_refused(torch, ovd, model, inputs, stand_in, "FusedAttnProcessor2_0")


@pytest.mark.parametrize("cls", ["UNet3DConditionModel", "UNetSpatioTemporalConditionModel"])
def test_default_processor_is_refused(torch, ovd, stand_in, cls):
    """set_default_attn_processor puts diffusers' AttnProcessor (softmax(QK^T) V in torch ops) in: refused too."""
    model, inputs = MODELS[cls][0](torch)
    model.set_default_attn_processor()
    assert {type(p).__name__ for _, p in processor_objects(model)} == {"AttnProcessor"}
    assert_apply_refused(torch, ovd, model, inputs, stand_in, "AttnProcessor")
