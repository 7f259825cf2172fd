"""Sizes, constants and tensor layouts shared by every GPU module of open_vc_attn (torch-free).

The constants that the C++ library defines are mirrored here and checked against the extension's
exports by tests/python/test_package_structure.py (one source of truth, verified):
``DEFAULT_MID_WINDOW_BLOCKS`` (``openvc::AttentionParams{}.mid_window_blocks``, the default key traversal
of every Python function), ``PACKED_KEY_ORDER`` (``openvc::kPackedKeyOrder``), ``NATURAL_ORDER``,
``QUANT_BLOCK``, ``INT8_KEY_GROUPS`` (``openvc::kInt8KeyGroups``) and the enum names ``QK_FORMATS`` and
``P_FORMATS`` (``_openvc_ext.QkFormat``, ``_openvc_ext.PFormat``). They are not read from the
extension at import: ``import open_vc_attn`` stays cheap and must work where the extension is not built.
"""
from __future__ import annotations

DEFAULT_MID_WINDOW_BLOCKS = 4  # openvc::AttentionParams{}.mid_window_blocks (_openvc_ext.DEFAULT_MID_WINDOW_BLOCKS)
NATURAL_ORDER = -1             # openvc::kNaturalOrder
PACKED_KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)  # openvc::kPackedKeyOrder
QUANT_BLOCK = 128              # tokens per Q/K descale group and per packed-V padding unit (openvc::kQuantBlock)
INT8_KEY_GROUPS = 8            # INT8 K descale groups per 128-key block, 16 keys each (openvc::kInt8KeyGroups)
QK_FORMATS = ("e4m3", "int8")  # Q/K code formats (openvc::QkFormat kE4M3, kInt8; _openvc_ext.QkFormat.e4m3 / .int8)
# P formats (openvc::PFormat kExpCast, kExp2; _openvc_ext.PFormat.expcast / .exp2): ExpCast's linear code (the
# default) or the E4M3 rounding of the exponential ("exp2", INT8 Q/K only; docs/numerics.md, "P format").
P_FORMATS = ("expcast", "exp2")
# open_vc_attn::attention_fp8's path: the fast path where it can take the call, else the general path ("auto");
# the general path forced ("general": tests compare the two), or the fast path required ("fast").
ATTENTION_PATHS = ("auto", "fast", "general")
KERNEL_HEAD_DIM = 128          # the only head dim of the repair path and the VC baseline
FAST_HEAD_DIMS = (128, 64)     # the sm_90a fast path (dense, causal, packed sequences, key counts)
PREPARE_HEAD_DIMS = (128, 64)  # prepare_fp8, and the general path of attention / attention_fp8
INT_MAX = 2**31 - 1            # sizes and mid_window_blocks are C++ ints
GRID_LIMIT = 65535             # the general path's batch, heads and num_seqs are CUDA grid dimensions y/z
VERSIONS = {"open-vc": "expcast", "reference": "bf16"}   # attention's version -> its one mode

FP8_NAMES = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale")
FP8_LAYOUTS = ("[B, Sq, H, D]", "[B, H, ceil(Sq/128)]", "[B, Sk, H, D]", "[B, H, ceil(Sk/128)]",
               "[B, H, D, ceil(Sk/128)*128]", "[B, H]")
# qk_format "int8": one Q descale per query row, one K descale per (128-key block, 16-key group).
INT8_LAYOUTS = ("[B, Sq, H, D]", "[B, H, Sq]", "[B, Sk, H, D]", "[B, H, ceil(Sk/128), 8]",
                "[B, H, D, ceil(Sk/128)*128]", "[B, H]")
CODE_DTYPES = {"e4m3": "uint8", "int8": "int8"}   # torch dtype name of the Q/K codes per qk_format
VC_NAMES = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_channel_descale", "block_mean_scaled")


def blocks(s):
    """ceil(s / QUANT_BLOCK): descale groups of s tokens (works on torch.SymInt too)."""
    return (s + QUANT_BLOCK - 1) // QUANT_BLOCK


def padded(s):
    """s rounded up to whole QUANT_BLOCK tiles (packed V columns, repair rows)."""
    return blocks(s) * QUANT_BLOCK


def layouts(qk_format="e4m3"):
    """The six prepared tensors' layouts (as messages write them) of a qk_format."""
    return INT8_LAYOUTS if qk_format == "int8" else FP8_LAYOUTS


def _qk_descales(n, sq, sk, h, qk_format, hk=None):
    """(q_descale shape, k_descale shape) of a preparation of n sequences (Sq, Sk: the max lengths; hk: the
    K/V head count, None: h)."""
    nk, hk = blocks(sk), h if hk is None else hk
    if qk_format == "int8":
        return (n, h, sq), (n, hk, nk, INT8_KEY_GROUPS)
    return (n, h, blocks(sq)), (n, hk, nk)


def fp8_expectations(b, sq, sk, h, d, qk_format="e4m3", v_blocks=False, hk=None):
    """(name, shape, dtype name) of the six prepared tensors of PreparedFP8, in op order. qk_format "int8":
    int8 Q/K codes, q_descale [B, H, Sq] (one per row), k_descale [B, H, ceil(Sk/128), INT8_KEY_GROUPS].
    v_blocks: v_descale [B, H, ceil(Sk/128)], one per key block (attention_fp8 only). hk: the K/V head count
    (GQA/MQA: the K/V side's tensors hold hk heads where the layouts say H), None: h."""
    nk, codes, hk = blocks(sk), CODE_DTYPES[qk_format], h if hk is None else hk
    qd, kd = _qk_descales(b, sq, sk, h, qk_format, hk)
    return (("q_codes", (b, sq, h, d), codes), ("q_descale", qd, "float32"),
            ("k_codes", (b, sk, hk, d), codes), ("k_descale", kd, "float32"),
            ("v_packed", (b, hk, d, nk * QUANT_BLOCK), "uint8"),
            ("v_descale", (b, hk, nk) if v_blocks else (b, hk), "float32"))


def varlen_expectations(n, total_q, total_k, h, d, max_q, max_k, qk_format="e4m3", v_blocks=False, hk=None):
    """(name, shape, dtype name) of a packed-sequence preparation (N sequences), in op order (qk_format
    "int8": q_descale [N, H, max_q], k_descale [N, H, ceil(max_k/128), INT8_KEY_GROUPS], int8 codes;
    v_blocks: v_descale [N, H, ceil(max_k/128)]; hk: the K/V head count, None: h)."""
    nk, codes, hk = blocks(max_k), CODE_DTYPES[qk_format], h if hk is None else hk
    qd, kd = _qk_descales(n, max_q, max_k, h, qk_format, hk)
    return (("q_codes", (total_q, h, d), codes), ("q_descale", qd, "float32"),
            ("k_codes", (total_k, hk, d), codes), ("k_descale", kd, "float32"),
            ("v_packed", (n, hk, d, nk * QUANT_BLOCK), "uint8"),
            ("v_descale", (n, hk, nk) if v_blocks else (n, hk), "float32"))


def vc_expectations(b, sq, sk, h, d):
    """(name, shape, dtype name) of the seven VC-prepared tensors of PreparedVC, in op order."""
    nq, nk = blocks(sq), blocks(sk)
    return (("q_codes", (b, sq, h, d), "uint8"), ("q_descale", (b, h, nq), "float32"),
            ("k_codes", (b, sk, h, d), "uint8"), ("k_descale", (b, h, nk), "float32"),
            ("v_packed", (b, h, d, nk * QUANT_BLOCK), "uint8"), ("v_channel_descale", (b, h, d), "float32"),
            ("block_mean_scaled", (b, h, nk, d), "float32"))


def repair_expectations(b, h, d, rows):
    """(name, shape, dtype name) of the four repair tensors of PreparedRepair.tensors(), in op order."""
    rp = padded(rows)
    return (("k_codes", (b, h, rp, d), "uint8"), ("k_descale", (b, h, rp), "float32"),
            ("v_packed", (b, h, d, rp), "uint8"), ("tokens", (b, h, rows), "int32"))


def packed_columns():
    """The inverse of PACKED_KEY_ORDER: key k of a 16-key group sits in packed column packed_columns()[k]."""
    order = PACKED_KEY_ORDER
    cols = [0] * len(order)
    for col, key in enumerate(order):
        cols[key] = col
    return tuple(cols)
