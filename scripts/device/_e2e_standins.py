"""The CPU stand-ins of scripts/device/diffusers_e2e.py's --dry-run and --shapes-only: openvc's kernel replaced by
FP32 torch SDPA (the policy's device check passing CPU and meta tensors), and the meta-device shims some models'
forwards need. Neither measures anything; they let the GPU script's code paths run where there is no GPU.
"""
import contextlib


@contextlib.contextmanager
def fast_path_stand_in(torch, ovd, ovp):
    """--dry-run / --shapes-only: the policy's device check passes CPU and meta tensors, and openvc's kernel
    is replaced by torch SDPA in FP32 with the same key mask or key counts (meta: an empty output), so that the
    calls take the path they take on the GPU and the openvc branch of the integration (mask and scale passing)
    runs."""
    saved = ovp._device_reason, ovd._fast_attention

    def stand_in(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, qk_format="e4m3", k_smoothing=False,
                 p_format="expcast", seqused_k=None, v_bias_correction=False):
        # (the stand-in computes FP32 SDPA whatever the policy's Q/K and P formats and V bias correction)
        if q.device.type == "meta":
            out = torch.empty_like(q)
        else:
            if seqused_k is not None:     # the first seqused_k[b] keys of entry b
                attn_mask = torch.arange(k.shape[1], device=k.device)[None, :] < seqused_k[:, None].long()
            mask = None if attn_mask is None else attn_mask.reshape(q.shape[0], 1, 1, k.shape[1])
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), attn_mask=mask,
                scale=scale, is_causal=causal, enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2).to(torch.bfloat16)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        return (out, lse) if return_lse else out

    ovp._device_reason, ovd._fast_attention = (lambda device: None), stand_in
    try:
        yield
    finally:
        ovp._device_reason, ovd._fast_attention = saved


@contextlib.contextmanager
def meta_shims(torch):
    """--shapes-only: torch.autocast rejects the meta device (Mochi's RoPE opens one): a no-op there; and
    torch.nonzero on meta (diffusers' Mochi processor gathers the valid text tokens with it) assumes every
    element nonzero: shapes only."""
    from torch.fx.experimental import _config as fx_config
    saved = torch.autocast, fx_config.meta_nonzero_assume_all_nonzero

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else saved[0](device_type, *args, **kwargs)

    torch.autocast, fx_config.meta_nonzero_assume_all_nonzero = autocast, True
    try:
        yield
    finally:
        torch.autocast, fx_config.meta_nonzero_assume_all_nonzero = saved
