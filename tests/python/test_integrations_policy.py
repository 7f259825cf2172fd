"""The dispatch policy of the framework integrations (open_vc_attn.integrations.policy), without torch:
choose_path only reads shapes, dtypes, strides, storage offsets and devices, so stand-in tensors exercise
every decision. Runs anywhere (CI has no torch)."""
import collections

import pytest

try:
    from open_vc_attn.integrations import policy
except ImportError as exc:   # an installed copy older than the integrations package
    pytest.skip(f"open_vc_attn.integrations is not importable ({exc}): reinstall the package",
                allow_module_level=True)

Device = collections.namedtuple("Device", "type index")
CUDA0 = Device("cuda", 0)


class FakeTensor:
    """What choose_path reads of a torch.Tensor. dtype is its str(), as choose_path compares it."""

    def __init__(self, shape, dtype="torch.bfloat16", strides=None, offset=0, device=CUDA0, requires_grad=False):
        self.shape = tuple(shape)
        if strides is None:   # contiguous
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self._strides, self._offset = tuple(strides), offset
        self.dtype, self.device, self.requires_grad = dtype, device, requires_grad

    def dim(self):
        return len(self.shape)

    def stride(self):
        return self._strides

    def storage_offset(self):
        return self._offset

    def is_contiguous(self):
        return self._strides == FakeTensor(self.shape)._strides

    def unsqueeze(self, dim):
        assert dim == 0
        return FakeTensor((1,) + self.shape, self.dtype, (self.shape[0] * self._strides[0],) + self._strides,
                          self._offset, self.device, self.requires_grad)


S = 32768   # tokens of a long self-attention: above the default thresholds (DEFAULT below)
DEFAULT = policy.DEFAULT_POLICY


def qkv(b=1, sq=S, sk=None, h=12, d=128, hk=None, **kw):
    sk = sq if sk is None else sk
    return FakeTensor((b, sq, h, d), **kw), FakeTensor((b, sk, hk or h, d), **kw), FakeTensor((b, sk, hk or h, d), **kw)


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    """Device 0 reads as compute capability 9.0 (the cache is what the policy consults before torch)."""
    monkeypatch.setattr(policy, "_capability_cache", {0: (9, 0)})


def test_long_self_attention_takes_openvc():
    assert policy.choose_path(*qkv()) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(b=2, sq=32760, dtype="torch.float16")) == (policy.OPENVC, "")
    # the thresholds are inclusive
    assert policy.choose_path(*qkv(sq=DEFAULT.min_query_tokens, sk=DEFAULT.min_key_tokens)) == (policy.OPENVC, "")


def test_default_thresholds_are_the_measured_crossover():
    """The defaults are the committed record's crossover (DispatchPolicy's docstring cites it): the
    threshold rectangle inside which openvc beat torch SDPA at every measured point and every head count,
    holding the most of the grid's work."""
    import json
    import pathlib
    record = pathlib.Path(__file__).resolve().parents[2] / policy.CROSSOVER_RECORD
    best = json.loads(record.read_text())["policy_rectangles"]["sdpa"][0]
    assert (DEFAULT.min_query_tokens, DEFAULT.min_key_tokens) == (best["min_query_tokens"], best["min_key_tokens"])
    assert policy.CROSSOVER_RECORD in policy.DispatchPolicy.__doc__.replace("\n    ", "")


@pytest.mark.parametrize("kwargs, reason", [
    (dict(attn_mask=FakeTensor((1, 1, S, S), "torch.bool")), "attn_mask per query (not a key padding mask)"),
    (dict(attn_mask=FakeTensor((1, 12, 1, S), "torch.bfloat16")), "attn_mask per head"),
    (dict(attn_mask=FakeTensor((1, S), "torch.int64")), "attn_mask dtype torch.int64 (takes bool or an additive "
                                                           "float mask)"),
    (dict(attn_mask=FakeTensor((1, 1, 1, S), "torch.bool"), causal=True), "attn_mask with causal"),
    (dict(dropout_p=0.1), "dropout"),
])
def test_options_fall_back(kwargs, reason):
    assert policy.choose_path(*qkv(), **kwargs) == (policy.FALLBACK, reason)


@pytest.mark.parametrize("mask_shape, dtype", [((1, S), "torch.bool"), ((1, 1, S), "torch.float32"),
                                               ((1, 1, 1, S), "torch.bfloat16")])
def test_key_padding_masks_and_causal_self_attention_take_openvc(mask_shape, dtype):
    # key padding masks (HunyuanVideo's text padding) and causal self-attention run on the fast path
    assert policy.choose_path(*qkv(), attn_mask=FakeTensor(mask_shape, dtype)) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(), causal=True) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(sq=1500, sk=S), causal=True)[0] == policy.FALLBACK   # top-left vs end


@pytest.mark.parametrize("shape_kw, prefix", [
    (dict(sk=512), f"few keys (512 < {DEFAULT.min_key_tokens})"),   # Wan text cross-attention
    (dict(sk=257), "few keys"),                       # Wan I2V image tokens
    (dict(sq=DEFAULT.min_query_tokens - 1), "short query"),
    (dict(sq=S, sk=DEFAULT.min_key_tokens - 1), "few keys"),
    (dict(d=96), "head_dim 96"),                      # neither 128 nor 64
    (dict(h=12, hk=5), "gqa: 5 key/value heads do not divide 12 query heads"),
    (dict(dtype="torch.float32"), "dtype"),
    (dict(requires_grad=True), "requires_grad"),
    (dict(device=Device("cpu", None)), "device"),
])
def test_shapes_and_kinds_fall_back(shape_kw, prefix):
    path, why = policy.choose_path(*qkv(**shape_kw))
    assert path == policy.FALLBACK and why.startswith(prefix), why


@pytest.mark.parametrize("h, hk", [(12, 4), (32, 8), (12, 1), (12, 12)])
def test_grouped_query_attention_takes_openvc(h, hk):
    """GQA / MQA (diffusers' enable_gqa=True calls, Cosmos 3's 32 query / 8 key-value heads): key/value heads
    dividing the query heads take openvc as they are, in every call form and format."""
    assert policy.choose_path(*qkv(h=h, hk=hk)) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(h=h, hk=hk), causal=True) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(h=h, hk=hk, d=64), attn_mask=FakeTensor((1, S), "torch.bool")) == (policy.OPENVC, "")
    int8 = policy.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2")
    assert policy.choose_path(*qkv(h=h, hk=hk), policy=int8) == (policy.OPENVC, int8.format_label)
    q, _, _, cu = packed(h=h)
    kv = FakeTensor((6000, hk, 128))
    assert policy.choose_varlen_path(q, kv, kv, cu, cu, 2048, 2048, causal=True, policy=KILO) == (policy.OPENVC, "")


def test_grouped_query_attention_falls_back_with_the_reason():
    q, k, v = qkv(h=12, hk=4)
    assert policy.choose_path(q, k, FakeTensor((1, S, 3, 128))) == (policy.FALLBACK, "shape mismatch")   # v's heads
    assert policy.choose_path(*qkv(h=12, hk=8)) == (policy.FALLBACK, "gqa: 8 key/value heads do not divide 12 query "
                                                                     "heads")
    # the general path (past the fast path's 32-bit range) takes equal head counts only
    big = 1 << 20
    assert policy.choose_path(*qkv(sq=big, h=12, hk=12)) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(sq=big, h=12, hk=4)) == (
        policy.FALLBACK, "gqa past the fast path's size range (ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32)")
    q, _, _, cu = packed(total=big)
    kv = FakeTensor((big, 4, 128))
    assert policy.choose_varlen_path(q, kv, kv, cu, cu, big, big, policy=KILO)[1].startswith("gqa past")


def test_layouts():
    q, k, v = qkv()
    # [B, S, H, D] view of a [B, H, S, D] buffer: strides multiples of 8, head dim contiguous: no copy needed
    bhsd = FakeTensor(q.shape, strides=(12 * S * 128, 128, S * 128, 1))
    assert policy.choose_path(bhsd, k, v)[0] == policy.OPENVC
    # a chunk of a fused qkv projection [B, S, 3*H*D]: sequence stride 3*H*D, offset H*D
    fused = FakeTensor(q.shape, strides=(3 * S * 1536, 3 * 1536, 128, 1), offset=1536)
    assert policy.choose_path(q, fused, fused)[0] == policy.OPENVC
    for bad in (FakeTensor(q.shape, strides=(S * 12 * 129, 12 * 129, 129, 1)),    # stride not x8
                FakeTensor(q.shape, strides=(1, 12 * S, S, S * 12)),       # head dim strided
                FakeTensor(q.shape, offset=4)):                                     # misaligned
        assert policy.choose_path(bad, k, v) == (policy.FALLBACK, "layout (strides or alignment)")


def test_rank_and_mismatches():
    q, k, v = qkv()
    assert policy.choose_path(FakeTensor((S, 12, 128)), k, v)[1].startswith("rank")
    assert policy.choose_path(q, k, FakeTensor((1, S, 12, 128), dtype="torch.float16"))[1].startswith("dtype")
    assert policy.choose_path(q, k, FakeTensor((1, 2 * S, 12, 128)))[1] == "shape mismatch"
    assert policy.choose_path(q, k, FakeTensor((1, S, 12, 128), device=Device("cuda", 1)))[1] == "devices differ"


def test_other_gpus_fall_back(monkeypatch):
    monkeypatch.setattr(policy, "_capability_cache", {0: (8, 0)})
    path, why = policy.choose_path(*qkv())
    assert path == policy.FALLBACK and why.startswith("compute capability 8.0")


def test_custom_policy():
    small = policy.DispatchPolicy(min_query_tokens=64, min_key_tokens=256)
    assert policy.choose_path(*qkv(sq=128, sk=512), policy=small) == (policy.OPENVC, "")
    assert policy.choose_path(*qkv(sq=128, sk=200), policy=small)[1].startswith("few keys")
    assert policy.choose_path(*qkv(d=64))[0] == policy.OPENVC   # LTX-Video: the fast path's D = 64 mode
    assert policy.choose_path(*qkv(d=64), policy=policy.DispatchPolicy(head_dims=(128,)))[1].startswith("head_dim")


def test_policy_arguments():
    for name in ("min_query_tokens", "min_key_tokens"):
        for bad in (0, -5, 1.5, True, None):
            with pytest.raises(ValueError, match=f"^{name}"):
                policy.DispatchPolicy(**{name: bad})
    for bad in ((), (96,), (128, 256)):
        with pytest.raises(ValueError, match="^head_dims"):
            policy.DispatchPolicy(head_dims=bad)


# ---- packed sequences (choose_varlen_path) ------------------------------------------------------------------

def packed(total=6000, h=12, d=128, n=3, **kw):
    """q, k, v [total, H, D] and one int32 offsets tensor [n + 1] (shared by queries and keys)."""
    cu = FakeTensor((n + 1,), "torch.int32", device=kw.get("device", CUDA0))
    return FakeTensor((total, h, d), **kw), FakeTensor((total, h, d), **kw), FakeTensor((total, h, d), **kw), cu


# Thresholds of 1024 tokens (the defaults are the measured crossover, far above these stand-ins).
KILO = policy.DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024)


def test_packed_long_sequences_take_openvc():
    q, k, v, cu = packed()
    assert policy.choose_varlen_path(q, k, v, cu, cu, 2048, 2048, policy=KILO) == (policy.OPENVC, "")
    assert policy.choose_varlen_path(q, k, v, cu, cu, 1024, 1024, causal=True, policy=KILO) == (policy.OPENVC, "")
    # the thresholds are per sequence (max_seqlen), not on the packed total
    assert policy.choose_varlen_path(q, k, v, cu, cu, 1023, 1023, policy=KILO) == \
        (policy.FALLBACK, "short sequences (max_seqlen_q 1023 < 1024)")
    assert policy.choose_varlen_path(q, k, v, cu, cu, 2048, 512, policy=KILO) == \
        (policy.FALLBACK, "few keys per sequence (max_seqlen_k 512 < 1024)")
    small = policy.DispatchPolicy(min_query_tokens=64, min_key_tokens=64)
    assert policy.choose_varlen_path(q, k, v, cu, cu, 100, 100, policy=small) == (policy.OPENVC, "")


def test_packed_calls_fall_back_with_the_reason():
    q, k, v, cu = packed()
    other = FakeTensor((4,), "torch.int32")
    cases = [
        ((FakeTensor((1, 6000, 12, 128)), k, v, cu, cu, 2048, 2048), {}, "rank: expected packed [T, H, D] tensors"),
        ((q, k, v, FakeTensor((4,), "torch.int64"), cu, 2048, 2048), {}, "cu_seqlens_q: dtype torch.int64"),
        ((q, k, v, cu, FakeTensor((4, 1), "torch.int32"), 2048, 2048), {}, "cu_seqlens_k: expected 1-D offsets"),
        ((q, k, v, FakeTensor((8,), "torch.int32", strides=(2,)), cu, 2048, 2048), {}, "cu_seqlens_q: dtype"),
        ((q, k, v, cu, FakeTensor((4,), "torch.int32", device=Device("cuda", 1)), 2048, 2048), {},
         "cu_seqlens_k device"),
        ((q, k, v, cu, FakeTensor((5,), "torch.int32"), 2048, 2048), {}, "cu_seqlens_q and cu_seqlens_k count"),
        ((q, k, v, cu, cu, None, 2048), {}, "max_seqlen_q None (takes a Python int >= 1)"),
        ((q, k, v, cu, cu, 2048, True), {}, "max_seqlen_k True"),
        ((q, k, v, cu, other, 2048, 2048), dict(causal=True), "causal with separate query and key offsets"),
        ((q, k, v, cu, cu, 2048, 2048), dict(dropout_p=0.1), "dropout"),
        (packed(d=96)[:3] + (cu, cu, 2048, 2048), {}, "head_dim 96"),
        (packed(dtype="torch.float32")[:3] + (cu, cu, 2048, 2048), {}, "dtype"),
        (packed(device=Device("cpu", None)), {}, None),
    ]
    for args, kw, prefix in cases:
        if prefix is None:                        # CPU tensors (their offsets too): the device rule
            q2, k2, v2, cu2 = args
            args, prefix = (q2, k2, v2, cu2, cu2, 2048, 2048), "device"
        path, why = policy.choose_varlen_path(*args, policy=KILO, **kw)
        assert path == policy.FALLBACK and why.startswith(prefix), (prefix, why)
    # separate offsets without causal are fine (cross-attention between packed sequences)
    assert policy.choose_varlen_path(q, k, v, cu, other, 2048, 2048, policy=KILO) == (policy.OPENVC, "")


# ---- the Q/K format of openvc's calls (qk_format, k_smoothing) ------------------------------------------------

def test_policy_format_fields_are_validated():
    assert (DEFAULT.qk_format, DEFAULT.k_smoothing) == ("e4m3", False)
    for bad in ("INT8", "fp8", "", None, 8):
        with pytest.raises(ValueError, match="^qk_format: expected one of"):
            policy.DispatchPolicy(qk_format=bad)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="^k_smoothing: expected a bool"):
            policy.DispatchPolicy(k_smoothing=bad)
    int8 = policy.DispatchPolicy(qk_format="int8", k_smoothing=True)
    assert int8.openvc_kwargs() == {"qk_format": "int8", "k_smoothing": True, "p_format": "expcast",
                                    "v_bias_correction": False}
    assert DEFAULT.openvc_kwargs() == {"qk_format": "e4m3", "k_smoothing": False, "p_format": "expcast",
                                       "v_bias_correction": False}


def test_policy_p_format_is_validated():
    """p_format: "expcast" (default) or "exp2", which needs qk_format "int8" (the rule of _checks.p_format)."""
    assert DEFAULT.p_format == "expcast"
    for bad in ("EXP2", "exp", "", None, 2):
        with pytest.raises(ValueError, match="^p_format: expected one of \\['expcast', 'exp2'\\]"):
            policy.DispatchPolicy(qk_format="int8", p_format=bad)
    for smooth in (False, True):
        with pytest.raises(ValueError, match="^p_format: 'exp2' .* INT8 Q/K only .*got qk_format='e4m3'"):
            policy.DispatchPolicy(p_format="exp2", k_smoothing=smooth)
    exp2 = policy.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2")
    assert exp2.openvc_kwargs() == {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2",
                                    "v_bias_correction": False}
    assert exp2.format_label == "qk_format=int8, k_smoothing, p_format=exp2"
    assert policy.DispatchPolicy(qk_format="int8", p_format="exp2").format_label == "qk_format=int8, p_format=exp2"
    # explicit defaults read as the defaults
    assert policy.DispatchPolicy(p_format="expcast").format_label == ""


def test_policy_v_bias_correction_is_validated():
    """v_bias_correction: a bool (TypeError naming it otherwise), True with qk_format "int8" only (ValueError naming
    it with "e4m3", the rule of _checks.v_bias_correction); passed to every openvc call and named in the reason."""
    assert DEFAULT.v_bias_correction is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(TypeError, match="^v_bias_correction: expected a bool"):
            policy.DispatchPolicy(qk_format="int8", v_bias_correction=bad)
    for kw in (dict(), dict(qk_format="e4m3"), dict(k_smoothing=True)):
        with pytest.raises(ValueError, match="^v_bias_correction: .*qk_format='int8'.*got qk_format='e4m3'"):
            policy.DispatchPolicy(v_bias_correction=True, **kw)
    assert policy.DispatchPolicy(v_bias_correction=False).format_label == ""     # the default, explicit
    best = policy.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2", v_bias_correction=True)
    assert best.openvc_kwargs() == {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2",
                                    "v_bias_correction": True}
    assert best.format_label == "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction"
    plain = policy.DispatchPolicy(qk_format="int8", v_bias_correction=True)
    assert plain.format_label == "qk_format=int8, v_bias_correction"
    assert plain.openvc_kwargs()["v_bias_correction"] is True
    # dense, causal and packed calls take it (the fast path's INT8 calls); the label is the reason
    small = dict(min_query_tokens=1024, min_key_tokens=1024)
    pol = policy.DispatchPolicy(qk_format="int8", k_smoothing=True, p_format="exp2", v_bias_correction=True, **small)
    q, k, v, cu = packed()
    assert policy.choose_path(*qkv(), policy=pol) == (policy.OPENVC, best.format_label)
    assert policy.choose_path(*qkv(), causal=True, policy=pol) == (policy.OPENVC, best.format_label)
    assert policy.choose_varlen_path(q, k, v, cu, cu, 2048, 2048, policy=pol) == (policy.OPENVC, best.format_label)


def test_openvc_reason_names_the_format():
    """The reason of an openvc call is the format ("" for the default): what the integrations' stats show."""
    labels = {("e4m3", False, "expcast"): "", ("int8", False, "expcast"): "qk_format=int8",
              ("int8", True, "expcast"): "qk_format=int8, k_smoothing",
              ("e4m3", True, "expcast"): "qk_format=e4m3, k_smoothing",
              ("int8", True, "exp2"): "qk_format=int8, k_smoothing, p_format=exp2",
              ("int8", False, "exp2"): "qk_format=int8, p_format=exp2"}
    q, k, v, cu = packed()
    for (fmt, smooth, pfmt), label in labels.items():
        pol = policy.DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024, qk_format=fmt, k_smoothing=smooth,
                                    p_format=pfmt)
        assert pol.format_label == label
        assert policy.choose_path(*qkv(), policy=pol) == (policy.OPENVC, label)
        assert policy.choose_varlen_path(q, k, v, cu, cu, 2048, 2048, policy=pol) == (policy.OPENVC, label)
        # a fallback keeps its own reason
        assert policy.choose_path(*qkv(sq=100), policy=pol)[0] == policy.FALLBACK


def test_int8_past_the_fast_path_range_falls_back():
    """INT8 runs on the fast path only: calls past its 32-bit range go to the framework (E4M3 takes them on
    openvc's general path). Packed calls are judged per sequence (max_seqlen), not on the packed total."""
    int8 = policy.DispatchPolicy(qk_format="int8")
    huge = 1 << 20   # ceil(S/128)^2 * 128 = 2^33
    path, why = policy.choose_path(*qkv(sq=huge), policy=int8)
    assert path == policy.FALLBACK and why.startswith("int8 past the fast path's size range")
    assert policy.choose_path(*qkv(sq=huge)) == (policy.OPENVC, "")
    q, k, v, cu = packed(total=4 * huge)
    assert policy.choose_varlen_path(q, k, v, cu, cu, 8192, 8192, policy=int8) == (policy.OPENVC, "qk_format=int8")
    assert policy.choose_varlen_path(q, k, v, cu, cu, huge, huge, policy=int8)[0] == policy.FALLBACK
