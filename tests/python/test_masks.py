"""open_vc_attn.masks on CPU: the video masks against dense element masks built here with plain torch (and
against FlexAttention's create_block_mask), block_lists against the dense block occupancy, and the messages of
check_block_lists and block_lists. Radial Attention's rule is re-derived here frame pair by frame pair, in the
float arithmetic of their code (github.com/mit-han-lab/radial-attention, radial_attn/attn_mask.py), independently
of the module's integer form."""
import subprocess
import sys
import warnings

import pytest

B = 128   # openvc's query tile and key block


@pytest.fixture(scope="module")
def masks(torch):
    from open_vc_attn import masks
    return masks


# ---- dense references -----------------------------------------------------------------------------------

def frames_of(torch, frames, t):
    return torch.arange(frames * t, dtype=torch.int32) // t


def dense_frame_causal(torch, frames, t):
    f = frames_of(torch, frames, t)
    return f[None, :] <= f[:, None]


def dense_window(torch, frames, t, radius):
    f = frames_of(torch, frames, t)
    return (f[:, None] - f[None, :]).abs() <= radius


def dense_radial(torch, frames, t, decay_factor=1.0, attention_sink=True):
    """Per frame pair (query frame i, key frame j), as their gen_log_mask_shrinked builds it before shrinking."""
    pos = torch.arange(t)
    out = torch.zeros(frames * t, frames * t, dtype=torch.bool)
    for i in range(frames):
        for j in range(frames):
            dist = abs(i - j)
            group = dist.bit_length()
            if attention_sink and j == 0:
                local = torch.ones(t, t, dtype=torch.bool)
            else:
                width = t if dist <= 1 else max(2 ** t.bit_length() / 2 ** group * decay_factor, 128)
                local = (pos[None, :] - pos[:, None]).abs() <= width
                decay = 2 ** t.bit_length() / 2 ** group
                if decay < 128 and dist % int(128 / decay) != 0:
                    local = torch.zeros_like(local)
            out[i * t:(i + 1) * t, j * t:(j + 1) * t] = local
    return out


def block_counts(torch, dense):
    """Visible elements per 128x128 block (the padding past the sequence counts as not visible)."""
    n = -(-dense.shape[0] // B)
    padded = torch.zeros(n * B, n * B, dtype=torch.int32)
    padded[:dense.shape[0], :dense.shape[1]] = dense
    return padded.view(n, B, n, B).sum(dim=(1, 3))


def listed(torch, counts, indices):
    """{(b, h, q): set of listed blocks} of block lists, checking each row's listed entries are unique."""
    out = {}
    for row in torch.cartesian_prod(*(torch.arange(s) for s in counts.shape)).view(-1, 3).tolist():
        n = int(counts[tuple(row)])
        entries = indices[tuple(row)][:n].tolist()
        assert len(set(entries)) == len(entries), (row, entries)
        out[tuple(row)] = set(entries)
    return out


CASES = [   # (builder name, positional args, keywords, dense reference)
    ("frame_causal", (3, 1560), {}, lambda torch: dense_frame_causal(torch, 3, 1560)),
    ("frame_causal", (4, 128), {}, lambda torch: dense_frame_causal(torch, 4, 128)),
    ("frame_causal", (2, 3600), {}, lambda torch: dense_frame_causal(torch, 2, 3600)),
    ("temporal_window", (5, 200, 1), {}, lambda torch: dense_window(torch, 5, 200, 1)),
    ("temporal_window", (3, 1560, 0), {}, lambda torch: dense_window(torch, 3, 1560, 0)),
    ("radial", (3, 1560), {}, lambda torch: dense_radial(torch, 3, 1560)),
    ("radial", (17, 130), {}, lambda torch: dense_radial(torch, 17, 130)),
    ("radial", (9, 300), {"attention_sink": False, "decay_factor": 0.6},
     lambda torch: dense_radial(torch, 9, 300, 0.6, False)),
    ("radial", (5, 100), {}, lambda torch: dense_radial(torch, 5, 100)),
]
IDS = [f"{name}{args}{''.join(f'-{k}={v}' for k, v in kw.items())}" for name, args, kw, _ in CASES]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=IDS)
def case(request, torch, masks):
    name, args, kwargs, reference = CASES[request.param]
    return getattr(masks, name)(*args, device="cpu", **kwargs), reference(torch)


# ---- the masks ------------------------------------------------------------------------------------------

def test_mask_mod_is_the_element_rule(torch, case):
    bm, dense = case
    i = torch.arange(dense.shape[0])
    assert bm.seq_lengths == (dense.shape[0], dense.shape[1])
    assert torch.equal(torch.broadcast_to(bm.mask_mod(0, 0, i[:, None], i[None, :]), dense.shape), dense)


def test_blocks_cover_the_visible_elements(torch, case):
    """Partial blocks: some but not all of the 128*128 elements visible; full: all; listed ascending."""
    bm, dense = case
    counts = block_counts(torch, dense)
    n = counts.shape[0]
    assert tuple(bm.BLOCK_SIZE) == (B, B)
    assert bm.kv_indices.shape == bm.full_kv_indices.shape == (1, 1, n, n)
    partial = listed(torch, bm.kv_num_blocks, bm.kv_indices)
    full = listed(torch, bm.full_kv_num_blocks, bm.full_kv_indices)
    for q in range(n):
        assert partial[0, 0, q] == {k for k in range(n) if 0 < counts[q, k] < B * B}, q
        assert full[0, 0, q] == {k for k in range(n) if counts[q, k] == B * B}, q
        row = bm.kv_indices[0, 0, q, :int(bm.kv_num_blocks[0, 0, q])]
        assert torch.all(row[1:] > row[:-1])


def test_same_block_mask_as_create_block_mask(torch, case):
    """FlexAttention's own classification of the same mask_mod gives identical tensors (q-side ones included)."""
    from torch.nn.attention.flex_attention import create_block_mask
    bm, dense = case
    if dense.shape[0] > 5000:
        pytest.skip("create_block_mask materializes [Q, KV] int64 temporaries: too large for a CPU test")
    ref = create_block_mask(bm.mask_mod, 1, 1, *bm.seq_lengths, device="cpu", BLOCK_SIZE=B)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    assert bm.seq_lengths == ref.seq_lengths


def test_block_lists_are_the_block_occupancy(torch, masks, case):
    bm, dense = case
    counts = block_counts(torch, dense)
    kv_num_blocks, kv_indices = masks.block_lists(bm)
    n = counts.shape[0]
    assert kv_num_blocks.dtype == kv_indices.dtype == torch.int32
    assert kv_num_blocks.shape == (1, 1, n) and kv_indices.shape == (1, 1, n, n)
    assert kv_num_blocks.is_contiguous() and kv_indices.is_contiguous()
    for q in range(n):
        expect = [k for k in range(n) if counts[q, k] > 0]
        assert int(kv_num_blocks[0, 0, q]) == len(expect)
        assert kv_indices[0, 0, q].tolist() == expect + [0] * (n - len(expect))   # ascending, then zeros
    masks.check_block_lists(kv_num_blocks, kv_indices, batch=2, heads=3, seqlen_q=dense.shape[0],
                            seqlen_k=dense.shape[1], check_inputs=True)


def test_flex_attention_applies_the_element_mask(torch, masks):
    """FlexAttention (eager, CPU) with a radial BlockMask equals SDPA with the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention
    bm = masks.radial(5, 150, device="cpu")
    dense = dense_radial(torch, 5, 150)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 750, 64, generator=gen) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # eager flex_attention's "not compiled" warning
        out = flex_attention(q, k, v, block_mask=bm)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert torch.allclose(out, ref, atol=1e-5)


def test_radial_widths_of_their_code(masks):
    """The per-distance spatial window at 1560 tokens a frame (Wan 2.1 480p; S = 2048): whole frames at distance
    0 and 1, then S/4 = 512 at 2-3, 256 at 4-7, 128 at 8-15; at 16-31 D = 64 < 128, so only even distances stay."""
    from open_vc_attn.masks import _radial_widths
    w = _radial_widths(20, 1560, 1.0)
    assert w[:4] == [1560, 1560, 512, 512] and w[4:8] == [256] * 4 and w[8:16] == [128] * 8
    assert w[16:20] == [128, -1, 128, -1]
    assert _radial_widths(4, 3600, 0.5)[2:] == [512, 512]   # S = 4096, D(2) = 1024, times decay_factor
    assert _radial_widths(3, 100, 1.0) == [100, -1, -1]     # under 128 tokens a frame: D(1) = 64 < 128


def test_partial_blocks_straddle_frame_boundaries(torch, masks):
    """Frames of 200 tokens: key block 1 (tokens 128-255) holds frame 0 and frame 1 tokens; under frame_causal
    query tile 0 (frame 0) lists it, so openvc, visiting it whole, lets tokens 0-127 see tokens 200-255."""
    bm = masks.frame_causal(2, 200, device="cpu")
    kv_num_blocks, kv_indices = masks.block_lists(bm)
    assert kv_num_blocks[0, 0].tolist() == [2, 4, 4, 4]
    assert kv_indices[0, 0, 0].tolist() == [0, 1, 0, 0]
    assert int(bm.full_kv_num_blocks[0, 0, 0]) == 1 and int(bm.kv_num_blocks[0, 0, 0]) == 1


def test_batch_and_heads(torch, masks):
    one = masks.temporal_window(3, 300, 1, device="cpu")
    many = masks.temporal_window(3, 300, 1, batch=2, heads=3, device="cpu")
    assert many.kv_num_blocks.shape == (2, 3, 8) and many.full_kv_indices.shape == (2, 3, 8, 8)
    counts, indices = masks.block_lists(many)
    assert counts.shape == (2, 3, 8) and indices.shape == (2, 3, 8, 8) and indices.is_contiguous()
    one_counts, one_indices = masks.block_lists(one)
    assert torch.equal(counts, one_counts.expand(2, 3, 8)) and torch.equal(indices, one_indices.expand(2, 3, 8, 8))
    masks.check_block_lists(counts, indices, batch=2, heads=3, seqlen_q=900, seqlen_k=900, check_inputs=True)
    masks.check_block_lists(one_counts, one_indices, batch=2, heads=3, seqlen_q=900, seqlen_k=900)


def test_default_device(torch, masks):
    counts, _ = masks.block_lists(masks.frame_causal(2, 300))
    assert counts.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("call, name", [
    (lambda m: m.frame_causal(0, 100), "frames"),
    (lambda m: m.frame_causal(2, 1.5), "tokens_per_frame"),
    (lambda m: m.frame_causal(2, 100, heads=0), "heads"),
    (lambda m: m.temporal_window(2, 100, -1), "radius"),
    (lambda m: m.radial(2, 100, decay_factor=0), "decay_factor"),
    (lambda m: m.radial(2, True), "tokens_per_frame"),
])
def test_mask_arguments(masks, call, name):
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        call(masks)


# ---- block_lists ----------------------------------------------------------------------------------------

def from_lists(torch, partial, full=None, seqlen=(512, 512), block=B):
    from torch.nn.attention.flex_attention import BlockMask
    t = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    args = [t(partial[0]), t(partial[1])] + ([t(full[0]), t(full[1])] if full else [None, None])
    return BlockMask.from_kv_blocks(*args, BLOCK_SIZE=block, seq_lengths=seqlen, compute_q_blocks=False)


def test_block_lists_merges_sorts_and_deduplicates(torch, masks):
    """Unsorted lists, a block in both lists, stale entries past the counts (some out of range): each row gets
    the ascending union, once, then zeros; the full lists broadcast over the partial lists' batch."""
    partial = ([[[2, 1, 0, 3]], [[1, 0, 0, 0]]],                              # B=2, H=1, Q_tiles=4
               [[[[3, 1, 9, 9], [2, 7, 7, 7], [0, 0, 0, 0], [0, 1, 2, 3]]],
                [[[0, 5, 5, 5], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]])
    full = ([[[1, 1, 0, 1]]], [[[[3, 2, 2, 2], [0, 9, 9, 9], [1, 1, 1, 1], [2, 0, 0, 0]]]])   # B=1
    counts, indices = masks.block_lists(from_lists(torch, partial, full))
    assert counts.tolist() == [[[2, 2, 0, 3]], [[2, 1, 0, 1]]]
    assert indices.tolist() == [[[[1, 3, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 1, 2, 0]]],
                                [[[0, 3, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0]]]]


def test_block_lists_without_full_blocks_and_uneven_lengths(torch, masks):
    """No full lists; KV_LEN 300 (3 key tiles) with 4-wide index rows: K_tiles follows KV_LEN."""
    bm = from_lists(torch, ([[[2, 3]]], [[[[2, 0, 1, 0], [1, 2, 0, 3]]]]), seqlen=(200, 300))
    counts, indices = masks.block_lists(bm)
    assert counts.tolist() == [[[2, 3]]] and indices.tolist() == [[[[0, 2, 0], [0, 1, 2]]]]


def test_block_lists_does_not_synchronize(torch, masks):
    """On the meta device every value read on the host (.item(), .tolist(), nonzero, boolean indexing) raises:
    block_lists runs there, so it reads none (CUDA graph capture and torch.compile need that)."""
    bm = masks.radial(4, 300, device="cpu")
    counts, indices = masks.block_lists(bm.to("meta"))
    assert counts.device.type == indices.device.type == "meta"
    assert counts.shape == (1, 1, 10) and indices.shape == (1, 1, 10, 10)
    compiled = torch.compile(masks.block_lists, fullgraph=True, backend="eager")
    for got, want in zip(compiled(bm), masks.block_lists(bm)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("block", [64, (128, 64), (64, 128)])
def test_block_lists_needs_128_blocks(torch, masks, block):
    bm = from_lists(torch, ([[[1]]], [[[[0]]]]), seqlen=(64, 64), block=block)
    with pytest.raises(ValueError, match=r"^block_mask: expected BLOCK_SIZE \(128, 128\)"):
        masks.block_lists(bm)


def test_block_lists_needs_a_block_mask(torch, masks):
    with pytest.raises(TypeError, match="^block_mask: expected a torch.nn.attention.flex_attention.BlockMask"):
        masks.block_lists((torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32)))


# ---- check_block_lists ----------------------------------------------------------------------------------

def lists(torch, counts, indices):
    return torch.tensor(counts, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32)


SIZES = dict(batch=2, heads=3, seqlen_q=200, seqlen_k=300)   # Q_tiles 2, key tiles 3


@pytest.mark.parametrize("change, error, message", [
    (lambda t, c, i: (c.long(), i), TypeError, r"^kv_num_blocks: expected dtype torch.int32, got torch.int64"),
    (lambda t, c, i: (c, i.short()), TypeError, r"^kv_indices: expected dtype torch.int32"),
    (lambda t, c, i: (c.tolist(), i), TypeError, r"^kv_num_blocks: expected a torch.Tensor"),
    (lambda t, c, i: (c[0], i), ValueError, r"^kv_num_blocks: expected rank 3, \[B, H, Q_tiles\]"),
    (lambda t, c, i: (c, i[0]), ValueError, r"^kv_indices: expected rank 4, \[B, H, Q_tiles, K_tiles\]"),
    (lambda t, c, i: (c.expand(3, 1, 2), i.expand(3, 1, 2, 3)), ValueError,
     r"^kv_num_blocks: expected \[B, H, Q_tiles\] with B in \(1, 2\), H in \(1, 3\), Q_tiles = ceil\(200/128\) = 2"),
    (lambda t, c, i: (c.expand(1, 2, 2), i.expand(1, 2, 2, 3)), ValueError, r"^kv_num_blocks: .*H in \(1, 3\)"),
    (lambda t, c, i: (c[..., :1], i[..., :1, :]), ValueError, r"^kv_num_blocks: .*Q_tiles = ceil\(200/128\) = 2"),
    (lambda t, c, i: (c, i.expand(2, 1, 2, 3)), ValueError,
     r"^kv_indices: expected \[B, H, Q_tiles, K_tiles\] = \[1, 1, 2"),
    (lambda t, c, i: (c, i[..., :0]), ValueError, r"^kv_indices: .*K_tiles >= 1"),
    (lambda t, c, i: (c, i.to("meta")), ValueError, r"^kv_indices: expected the device of kv_num_blocks \(cpu\)"),
])
def test_check_block_lists_shapes(torch, masks, change, error, message):
    counts, indices = change(torch, *lists(torch, [[[1, 2]]], [[[[0, 0, 0], [1, 2, 0]]]]))
    with pytest.raises(error, match=message):
        masks.check_block_lists(counts, indices, **SIZES)


def test_check_block_lists_accepts(torch, masks):
    counts, indices = lists(torch, [[[1, 3]], [[0, 2]]], [[[[0, 7, 7], [0, 1, 2]]], [[[9, 9, 9], [0, 2, -1]]]])
    masks.check_block_lists(counts, indices, **SIZES, check_inputs=True)   # entries past the counts are free
    masks.check_block_lists(counts, indices[..., :1], **SIZES)   # values are read only with check_inputs


@pytest.mark.parametrize("counts, indices, message", [
    ([[[1, 4]]], [[[[0, 1, 2, 3], [0, 1, 2, 3]]]],
     r"^kv_num_blocks: block lists of \(b, h, q_tile\) = \(0, 0, 1\): count 4 is outside \[0, 3\]"),
    ([[[1, 2]]], [[[[0], [0]]]], r"^kv_num_blocks: .*\(0, 0, 1\): count 2 is outside \[0, 1\] \(min\(K_tiles = 1"),
    ([[[-1, 0]]], [[[[0], [0]]]], r"^kv_num_blocks: .*\(0, 0, 0\): count -1"),
    ([[[1, 2]]], [[[[0, 0, 0], [1, 3, 0]]]],
     r"^kv_indices: block lists of \(b, h, q_tile\) = \(0, 0, 1\): entry 1 is 3, "
     r"outside \[0, ceil\(seqlen_k/128\) = 3\)"),
    ([[[1, 1]]], [[[[-1, 0, 0], [1, 3, 0]]]], r"^kv_indices: .*\(0, 0, 0\): entry 0 is -1"),
    ([[[2, 2]]], [[[[1, 1, 0], [2, 1, 0]]]],
     r"^kv_indices: .*\(0, 0, 0\): the listed indices are not strictly ascending \(entry 0 is 1, entry 1 is 1\)"),
])
def test_check_block_lists_values(torch, masks, counts, indices, message):
    counts, indices = lists(torch, counts, indices)
    masks.check_block_lists(counts, indices, **SIZES)   # no value check without check_inputs
    with pytest.raises(ValueError, match=message):
        masks.check_block_lists(counts, indices, **SIZES, check_inputs=True)


def test_check_block_lists_names_the_first_row(torch, masks):
    counts = torch.ones(2, 3, 2, dtype=torch.int32)
    indices = torch.zeros(2, 3, 2, 3, dtype=torch.int32)
    indices[1, 2, 0, 0] = 5
    indices[1, 1, 1, 0] = 4   # the earlier row in (b, h, q_tile) order
    with pytest.raises(ValueError, match=r"\(b, h, q_tile\) = \(1, 1, 1\): entry 0 is 4"):
        masks.check_block_lists(counts, indices, **SIZES, check_inputs=True)


# ---- import -----------------------------------------------------------------------------------------------

def test_import_does_not_import_torch():
    code = "import sys, open_vc_attn.masks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"], out
