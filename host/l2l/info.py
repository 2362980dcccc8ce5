"""What ``l2l info`` reports: the software, the devices, the EPS backends usable here."""
from __future__ import annotations

import platform

import numpy as np
import torch

from . import kernels
from .eps import BACKENDS, OPTIMIZERS
from .eps.choice import AUTO, choose
from .eps.threads import available_cpus
from .models import FAMILIES


def info_lines() -> list[str]:
    lines = [
        f"python      {platform.python_version()} ({platform.machine()})",
        f"torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"numpy       {np.__version__}",
        f"cpu threads {torch.get_num_threads()} (torch); {available_cpus()} CPUs this process may use",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}      {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda        none visible (training runs on the CPU, same code path)")
    for name, cls in BACKENDS.items():
        ok, why = cls.availability()
        runs = ", ".join(o for o in OPTIMIZERS if o in cls.optimizers)
        lines.append(f"eps {name:<9} {'available' if ok else 'unavailable'}: {why}; runs {runs}")
    auto = choose(AUTO, threads=None)
    lines.append(f"eps auto      takes {auto.name} on {auto.target} ({auto.why})")
    for kind in kernels.SOURCES:  # where the kernel sources were found: package data or a checkout
        lines.append(f"source {kind:<6} {kernels.describe(kind)}")
    lines.append(f"models      {', '.join(FAMILIES)}")
    return lines
