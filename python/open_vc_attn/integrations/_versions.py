"""Version gates of the integrations that use a framework's private hooks (diffusers' attention
registry, SGLang's backend selection, yunchang's processor): the tested series is accepted, any other
raises RuntimeError with the fix, unless the integration's OPENVC_*_UNTESTED=1 asks to try it (then a
RuntimeWarning)."""
from __future__ import annotations

import os
import warnings


def version_tuple(version: str, parts: int = 2) -> tuple:
    """The leading numbers of a version string: ("0.42.1", 2) -> (0, 42); ("0.5.10.post1", 3) -> (0, 5, 10)."""
    out = []
    for piece in version.split(".")[:parts]:
        digits = ""
        for c in piece:
            if not c.isdigit():
                break
            digits += c
        out.append(int(digits or 0))
    return tuple(out)


def gate_untested(supported: bool, message: str, env: str, stacklevel: int = 4) -> None:
    """Raises RuntimeError(message) for an untested version unless env=1, then warns (the message's part
    before its first ';')."""
    if supported:
        return
    if os.environ.get(env) != "1":
        raise RuntimeError(message)
    warnings.warn(message.split(";")[0] + f": untested, used because {env}=1", RuntimeWarning, stacklevel=stacklevel)
