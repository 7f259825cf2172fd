"""The BF16 first steps of ``apply(pipe, bf16_steps=N)``: which denoising step a diffusers pipeline is in.

The early denoising steps lay out a video's structure and are the most sensitive to attention error, so
xDiT and SageAttention3 users run them on BF16 attention and the rest quantized. What counts is the
*step*, not the transformer forward: a step makes one forward (classifier-free guidance as a batch of
2: HunyuanVideo, LTX), two (guidance as two forwards: Wan), and with two transformers (Wan2.2 A14B) each
sees only its own steps. So the counter comes from the scheduler, which every diffusers pipeline drives
the same way: ``scheduler.set_timesteps(...)`` once at the start of a run, ``scheduler.step(...)`` once
at the end of each denoising step. The number of ``step`` calls since the last ``set_timesteps`` is the
number of steps done: a forward (conditional or not, of any transformer) made while it is below N is in
the first N steps. An img2img run that starts late counts from its first step.

The two methods are wrapped on the scheduler instance (its class is untouched), with their signatures
(``retrieve_timesteps`` inspects ``set_timesteps``' parameters), and put back by :meth:`StepCounter.remove`.
A scheduler swapped in after ``apply`` (``pipe.scheduler = ...``) is not counted: the next attention call
raises RuntimeError asking for ``apply`` again.
"""
from __future__ import annotations

import functools
import weakref

__all__ = ["StepCounter", "REASON_PREFIX"]

REASON_PREFIX = "bf16_steps"      # the stats() reason of the calls the first steps move to the framework


class StepCounter:
    """Counts one pipeline's denoising steps (see the module doc); shared by its denoisers' routes."""

    def __init__(self, pipe, steps: int):
        scheduler = getattr(pipe, "scheduler", None)
        if not (callable(getattr(scheduler, "set_timesteps", None)) and callable(getattr(scheduler, "step", None))):
            raise ValueError(f"bf16_steps: counts the denoising steps by the pipeline's scheduler (set_timesteps, "
                             f"step), and {type(pipe).__name__}.scheduler is {type(scheduler).__name__}")
        self.steps = steps
        self.done = 0
        self.reason = f"{REASON_PREFIX}: first {steps} denoising steps on the framework's attention"
        self.scheduler = scheduler
        try:
            self._pipe = weakref.ref(pipe)
        except TypeError:                    # not weakly referenceable (a plain namespace): held
            self._pipe = lambda: pipe
        set_timesteps, step = scheduler.set_timesteps, scheduler.step

        @functools.wraps(set_timesteps)
        def counted_set_timesteps(*args, **kwargs):
            self.done = 0                    # a new run
            return set_timesteps(*args, **kwargs)

        @functools.wraps(step)
        def counted_step(*args, **kwargs):
            result = step(*args, **kwargs)
            self.done += 1
            return result

        self._wrappers = {"set_timesteps": counted_set_timesteps, "step": counted_step}
        self._saved = {name: scheduler.__dict__.get(name) for name in self._wrappers}   # earlier instance wrappers
        for name, fn in self._wrappers.items():
            setattr(scheduler, name, fn)

    def bf16_now(self) -> bool:
        """True while the pipeline runs one of its first ``steps`` denoising steps."""
        pipe = self._pipe()
        if pipe is not None and getattr(pipe, "scheduler", None) is not self.scheduler:
            raise RuntimeError("bf16_steps: pipe.scheduler was replaced after apply(pipe, bf16_steps=...), so its "
                               "steps are not counted; call apply(pipe, bf16_steps=...) again")
        return self.done < self.steps

    def remove(self):
        """Puts the scheduler's methods back as they were (a wrapper set on it after ours stays)."""
        for name, fn in self._wrappers.items():
            if self.scheduler.__dict__.get(name) is fn:
                if self._saved[name] is None:
                    del self.scheduler.__dict__[name]
                else:
                    self.scheduler.__dict__[name] = self._saved[name]
