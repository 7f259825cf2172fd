"""``python -m open_vc_attn.integrations.sglang_cli generate ...`` (or ``serve ...``): SGLang's ``sglang``
command with the openvc attention backend installed (docs/integrations/sglang.md).

:func:`open_vc_attn.integrations.sglang.install` runs at the top level of this module on purpose: SGLang
starts its GPU workers with the multiprocessing "spawn" method, and a spawned process re-runs the parent's
main module (here, this one, as ``__mp_main__``) before it unpickles its task, so every worker installs the
backend too. Environment: ``OPENVC_SGLANG_REPLACE`` (comma-separated, default "torch_sdpa,fa,fa2") names the
SGLang backends that openvc replaces.
"""
import os

from open_vc_attn.integrations import sglang as _openvc_sglang

_openvc_sglang.install(replace=tuple(
    name.strip() for name in os.environ.get("OPENVC_SGLANG_REPLACE", "torch_sdpa,fa,fa2").split(",") if name.strip()))

if __name__ == "__main__":
    from sglang.cli.main import main

    main()
