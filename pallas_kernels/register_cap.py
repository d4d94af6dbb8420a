"""A per-thread register cap for our Pallas-Triton kernels (PTX ``.maxnreg``).

Pallas' Triton ``CompilerParams`` take only ``num_warps`` and ``num_stages``, and ptxas
picks a kernel's register count freely (the fused encoder: 138 live at its peak, 168
allocated, so 6 programs of 2 warps an SM where 144 would fit 7 and 128 would fit 8).
A kernel asks for a cap through its name: ``capped_name("oscar_quantize_int2", 128)`` is
``"oscar_quantize_int2_maxnreg128"``; ``install()`` wraps Pallas' lowering to Triton IR
so that such a ``tt.func`` gets the ``nvvm.maxnreg`` attribute, which Triton's conversion
to LLVM keeps and the NVPTX backend writes as ``.maxnreg 128`` (checked offline with
Triton 3.6, and on the H200 through JAX 0.11.2's XLA Triton pipeline). The name is part
of the jit cache key, so each cap compiles its own kernel.

This reaches into JAX internals (``jax._src.pallas.triton.lowering``); where they are
missing ``install()`` returns False and the cap is a no-op, which changes no result (a
cap changes only register allocation: spills if the code needs more).
"""

from __future__ import annotations

import re
import threading

_TAG = "_maxnreg"
_NAME = re.compile(_TAG + r"(\d+)$")
_lock = threading.Lock()


def capped_name(base: str, max_registers: int | None) -> str:
    """The kernel name that asks for ``max_registers`` a thread (None: no cap)."""
    return base if max_registers is None else f"{base}{_TAG}{int(max_registers)}"


def cap_module(module) -> int:
    """Set ``nvvm.maxnreg`` on every ``tt.func`` of a Triton MLIR module named
    ``*_maxnregN``; returns how many were capped."""
    from jax._src.lib.mlir import ir

    n = 0
    with module.context:
        for op in module.body.operations:
            if op.operation.name != "tt.func" or "sym_name" not in op.attributes:
                continue
            m = _NAME.search(ir.StringAttr(op.attributes["sym_name"]).value)
            if m:
                i32 = ir.IntegerType.get_signless(32)
                op.attributes["nvvm.maxnreg"] = ir.IntegerAttr.get(i32, int(m.group(1)))
                n += 1
    return n


def install() -> bool:
    """Wrap Pallas' Triton lowering once (idempotent); False where JAX lacks it."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    with _lock:
        orig = getattr(lowering, "lower_jaxpr_to_triton_module", None)
        if orig is None:
            return False
        if getattr(orig, "_oscar_register_cap", False):
            return True

        def lower(*args, **kwargs):
            res = orig(*args, **kwargs)
            cap_module(res.module)
            return res

        lower._oscar_register_cap = True
        lowering.lower_jaxpr_to_triton_module = lower
    return True
