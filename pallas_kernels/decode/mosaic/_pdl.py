"""Programmatic dependent launch (PDL) for the decode's Mosaic launches.

A launch that waits on ``griddepcontrol.wait`` is made with CUDA's programmatic stream
serialization (Mosaic sets it when a kernel uses ``plgpu.griddepcontrol_wait``): its CTAs may
start while the launch before it in the stream is still running, once every CTA of that
launch has executed ``griddepcontrol.launch_dependents`` (or exited). What they do before the
wait (the launch itself, shared memory and barrier setup) overlaps the previous launch's
tail; the wait returns when that launch has completed and its writes are visible.

Rule of these kernels: with ``Int2DecodeConfig.pdl`` a kernel waits before its first global
memory access, read or write. Reading earlier is unsafe (an XLA fusion between two of our
launches may produce what the second reads), and so is writing (XLA may give the second
launch's output the buffer of something the previous one still reads).
"""

from __future__ import annotations


def _interpreting() -> bool:
    """Whether kernels are traced for Mosaic's GPU interpreter (``force_gpu_interpret_mode``),
    which has no rule for the grid-dependency instructions (they order launches only, so
    leaving them out there changes no value)."""
    from jax._src import config  # the interpreter's switch has no public reader

    mode = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
    return mode is not None and mode.value is not None


def wait_for_previous_launch(pdl: bool) -> None:
    """``griddepcontrol.wait`` (with ``pdl``): call first in a kernel body, before any load or
    store of global memory; it also marks the launch for programmatic serialization."""
    if pdl and not _interpreting():
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.griddepcontrol_wait()


def release_next_launch(pdl: bool) -> None:
    """``griddepcontrol.launch_dependents`` (with ``pdl``): lets the next launch's CTAs start
    once every CTA of this one has passed here. Called right after the wait: all of this
    launch's CTAs are then resident or done when the next one's start, so those only take
    the room this launch's finished CTAs leave, and wait in their prologue."""
    if pdl and not _interpreting():
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.griddepcontrol_launch_dependents()
