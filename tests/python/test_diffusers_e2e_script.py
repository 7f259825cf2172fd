"""scripts/device/diffusers_e2e.py on the CPU, so that the GPU run does not die on an API mismatch with the
installed diffusers: its block split, the dry run (tiny configs, torch SDPA standing in for openvc's
kernel: every model runs both ways and the calls take the paths they take on the GPU), and the real configs
at the real token counts on the meta device (the inputs fit the models; the calls by path a GPU run makes).
Skips without torch or diffusers."""
import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "device" / "diffusers_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("diffusers_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def calls(record):
    return {(c["path"], c["reason"]): c["calls"] for c in record["calls_per_forward"]}


def run(e2e, tmp_path, *argv):
    out = tmp_path / "e2e.json"
    assert e2e.main([*argv, "--json", str(out)]) == 0
    return {r["model"]: r for r in json.loads(out.read_text())["models"]}


def test_split_layers(e2e):
    hunyuan, motif = e2e.HUNYUAN["stacks"], e2e.MOTIF["stacks"]
    assert e2e.split_layers(hunyuan, None) == {"num_layers": 20, "num_single_layers": 40}
    assert e2e.split_layers(hunyuan, 6) == {"num_layers": 2, "num_single_layers": 4}
    assert e2e.split_layers(hunyuan, 1) == {"num_layers": 1, "num_single_layers": 1}     # one per stack at least
    assert e2e.split_layers(hunyuan, 999) == {"num_layers": 20, "num_single_layers": 40}
    # 12 : 16 : 8, a quarter of it; 4 blocks: 1.33 / 1.78 / 0.89 -> the largest remainders get the rest
    assert e2e.split_layers(motif, 9) == {"num_layers": 3, "single_encoder": 4, "num_decoder_layers": 2}
    assert e2e.split_layers(motif, 4) == {"num_layers": 1, "single_encoder": 2, "num_decoder_layers": 1}
    cfg, _ = e2e.model_config("motif", e2e.MOTIF, 9, False, None)
    # diffusers counts the decoder blocks among the single-stream ones
    assert (cfg["num_layers"], cfg["num_single_layers"], cfg["num_decoder_layers"]) == (3, 6, 2)


def test_dry_run_routes_as_on_the_gpu(e2e, tmp_path):
    recs = run(e2e, tmp_path, "--dry-run", "--runs", "1")
    # joint attention over video + text with the text padding as a bool key mask: openvc's path
    assert calls(recs["hunyuan"]) == {("openvc", ""): 2}
    # LTX: the self-attention (head dim 64) per the policy's head dims; cross-attention has a per-head mask
    ltx = calls(recs["ltx"])
    from open_vc_attn.integrations import policy
    self_path = ("openvc", "") if 64 in policy.DEFAULT_POLICY.head_dims else \
        ("fallback", f"head_dim 64/64/64 (takes {policy.DEFAULT_POLICY.head_dims})")
    assert ltx == {self_path: 1, ("fallback", "attn_mask per head"): 1}
    # Motif: joint attention of the dual and single blocks and the decoder's video + video attention on
    # openvc, the two text cross-attentions (12 keys) on the fallback
    assert calls(recs["motif"]) == {("openvc", ""): 3, ("fallback", "few keys (12 < 100)"): 2}
    # CogVideoX 1.0 / 1.5 and Mochi: joint attention through openvc's processors (diffusers' call torch SDPA)
    for name in ("cogvideox", "cogvideox15", "mochi"):
        assert calls(recs[name]) == {("openvc", ""): 1}, name
    # Cosmos 3: the video attention (8 query / 2 key-value heads: GQA as it is) on openvc, the prompt's causal
    # self-attention (12 tokens) on the fallback
    assert calls(recs["cosmos3"]) == {("openvc", ""): 1, ("fallback", "short query (12 < 100 tokens)"): 1}
    assert (recs["cosmos3"]["heads"], recs["cosmos3"]["kv_heads"]) == (8, 2)
    for r in recs.values():
        assert r["rel_l2_openvc_vs_native"] < 0.02      # the stand-in is SDPA in FP32: the mask was passed
        assert len(r["times_s"]["native"]) == len(r["times_s"]["openvc"]) == 1


def test_dry_run_with_the_formats(e2e, tmp_path):
    """--qk-format int8 --k-smoothing --p-format exp2 (and --v-bias-correction) reach the policy and name the openvc
    calls."""
    recs = run(e2e, tmp_path, "--dry-run", "--runs", "1", "--models", "hunyuan", "--qk-format", "int8",
               "--k-smoothing", "--p-format", "exp2")
    assert calls(recs["hunyuan"]) == {("openvc", "qk_format=int8, k_smoothing, p_format=exp2"): 2}
    policy = json.loads((tmp_path / "e2e.json").read_text())["policy"]
    assert (policy["qk_format"], policy["k_smoothing"], policy["p_format"]) == ("int8", True, "exp2")
    assert policy["v_bias_correction"] is False
    # --v-bias-correction: the most accurate mode
    recs = run(e2e, tmp_path, "--dry-run", "--runs", "1", "--models", "hunyuan", "--qk-format", "int8",
               "--k-smoothing", "--p-format", "exp2", "--v-bias-correction")
    assert calls(recs["hunyuan"]) == {("openvc", "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction"): 2}
    assert json.loads((tmp_path / "e2e.json").read_text())["policy"]["v_bias_correction"] is True


def test_real_shapes_on_meta(e2e, tmp_path):
    recs = run(e2e, tmp_path, "--shapes-only")       # every model
    hy, ltx, motif = recs["hunyuan"], recs["ltx"], recs["motif"]
    assert (hy["video_tokens"], hy["text_tokens"], hy["heads"], hy["head_dim"]) == (118_800, 256, 24, 128)
    assert hy["output_shape"] == [1, 16, 33, 90, 160]
    assert calls(hy) == {("openvc", ""): 6}                       # 2 dual + 4 single blocks
    assert (ltx["video_tokens"], ltx["text_tokens"], ltx["heads"], ltx["head_dim"]) == (6_144, 128, 32, 64)
    assert ltx["blocks"] == {"num_layers": 28} and ltx["output_shape"] == [1, 6144, 128]
    assert sum(calls(ltx).values()) == 56 and calls(ltx)[("fallback", "attn_mask per head")] == 28
    assert (motif["video_tokens"], motif["text_tokens"], motif["heads"]) == (114_080, 512, 12)
    assert motif["output_shape"] == [1, 16, 31, 92, 160]
    # 9 joint/decoder attentions; 7 text cross-attentions (3 dual + 4 encoder single blocks) to 512 keys
    assert calls(motif) == {("openvc", ""): 9, ("fallback", "few keys (512 < 4096)"): 7}
    assert 0.5e9 < motif["params"] < 0.6e9 and 1.5e9 < hy["params"] < 1.7e9 and 1.8e9 < ltx["params"] < 2.0e9
    cog, cog15, mochi = recs["cogvideox"], recs["cogvideox15"], recs["mochi"]
    # CogVideoX-5B, 720 x 480 x 49 frames: 13 x 30 x 45 patches + 226 text tokens, the whole model (5.6 B)
    assert (cog["video_tokens"], cog["text_tokens"], cog["heads"], cog["head_dim"]) == (17_550, 226, 48, 64)
    assert cog["output_shape"] == [1, 13, 16, 60, 90] and calls(cog) == {("openvc", ""): 42}
    assert 5.5e9 < cog["params"] < 5.7e9
    # CogVideoX1.5-5B, 1360 x 768 x 81 frames: 22 latent frames in pairs: 11 x 48 x 85 patches
    assert (cog15["video_tokens"], cog15["text_tokens"]) == (44_880, 226) and cog15["config"]["patch_size_t"] == 2
    assert cog15["output_shape"] == [1, 22, 16, 96, 170] and calls(cog15) == {("openvc", ""): 21}
    # Mochi-1 (10 B, half the blocks), 848 x 480 x 85 frames: 15 x 30 x 53 patches + 256 text tokens (200 padding)
    assert (mochi["video_tokens"], mochi["text_tokens"], mochi["text_padding"]) == (23_850, 256, 200)
    assert (mochi["heads"], mochi["head_dim"]) == (24, 128) and mochi["output_shape"] == [1, 12, 15, 60, 106]
    assert calls(mochi) == {("openvc", ""): 24} and 4.9e9 < mochi["params"] < 5.2e9
    # Cosmos 3 (class defaults, 15.2 B), 1280 x 720 x 189 frames: 48 x 23 x 40 patches + 256 prompt tokens; the video
    # attention of every layer on openvc with 8 key-value heads for 32 query heads, the prompt's on the fallback
    cos = recs["cosmos3"]
    assert (cos["video_tokens"], cos["text_tokens"], cos["heads"], cos["kv_heads"], cos["head_dim"]) == \
        (44_160, 256, 32, 8, 128)
    assert cos["output_shape"] == [1, 48, 48, 45, 80] and 15.0e9 < cos["params"] < 15.3e9
    assert calls(cos) == {("openvc", ""): 36, ("fallback", "short query (256 < 4096 tokens)"): 36}
