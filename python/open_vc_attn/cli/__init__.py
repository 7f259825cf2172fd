"""Command-line tools of open_vc_attn (``open-vc-attn-check``: see :mod:`open_vc_attn.cli.check`)."""
