"""torch.library custom ops over the GPU entry points of ``_openvc_ext`` (imports torch: import lazily).

Importing this package registers every op, the same way for all (``torch.library.custom_op`` with a
``register_fake`` implementation, at import of its module), so torch.compile(fullgraph=True) traces any
of them whichever openvc call comes first:

- :mod:`.call`: ``open_vc_attn::attention``, the op of :func:`open_vc_attn.attention`: BF16/FP16 q, k, v
  in, one C++ call (openvc::attention: preparation into one workspace, then the fast or the general path).
- :mod:`.fp8`: ``open_vc_attn::prepare_fp8`` (batched or packed sequences) and ``attention_fp8`` (the
  ops of :func:`open_vc_attn.prepare_fp8` and :func:`open_vc_attn.attention_fp8`; attention_fp8 takes the
  sm_90a fast path where it can and the CUDA-core general path elsewhere, or the one its ``path`` names).
- :mod:`.repair`: ``open_vc_attn::prepare_v_repair``, ``build_v_repair``, ``attention_fp8_repair``.
- :mod:`.vc`: ``open_vc_attn::vc_grouping``, ``prepare_vc``, ``attention_vc_fp8`` (the VC baseline).
- :mod:`.rotary`: ``open_vc_attn::rotary_pairs_`` and ``rotary_pairs_out`` (the rotary embedding, written
  into x or into a caller's tensor: the only ops here that mutate an argument).

The attention ops allocate their outputs (so ``mutates_args=()``), enqueue on ``torch.cuda.current_stream(device)``
and never synchronize; their fake implementations run the same argument checks
(:mod:`open_vc_attn._checks`) and give the same shapes, dtypes and strides, which is what torch.compile
and torch.library.opcheck need. The names below are the registered overloads, which torch.compile puts
in its graph as they are. Most users want :mod:`open_vc_attn.api` instead, whose eager calls run the
same CUDA implementations without the dispatcher hop (:func:`.direct.run`).
"""
import torch

from . import call, direct, fp8, repair, rotary, vc  # noqa: F401  (registers the ops; direct.run: api's eager calls)

__all__ = ["attention_op", "prepare_fp8_op", "attention_fp8_op", "prepare_v_repair_op", "build_v_repair_op",
           "attention_fp8_repair_op", "vc_grouping_op", "prepare_vc_op", "attention_vc_fp8_op", "rotary_pairs__op",
           "rotary_pairs_out_op"]

_ops = torch.ops.open_vc_attn
attention_op = _ops.attention.default
prepare_fp8_op = _ops.prepare_fp8.default
attention_fp8_op = _ops.attention_fp8.default
prepare_v_repair_op = _ops.prepare_v_repair.default
build_v_repair_op = _ops.build_v_repair.default
attention_fp8_repair_op = _ops.attention_fp8_repair.default
vc_grouping_op = _ops.vc_grouping.default
prepare_vc_op = _ops.prepare_vc.default
attention_vc_fp8_op = _ops.attention_vc_fp8.default
rotary_pairs__op = _ops.rotary_pairs_.default   # <op name>_op, as the others
rotary_pairs_out_op = _ops.rotary_pairs_out.default
