"""Join this local rank's memory cgroup, then become ``python ARGS``: how ``l2l bench shard``
gives each rank of a ``torchrun`` launch a limit of its own (torchrun starts the ranks).

Usage: ``L2L_BENCH_CGROUPS=procs0:procs1:... python -m l2l.bench.cgroup_exec -m l2l train ...``
"""
from __future__ import annotations

import os
import sys


def main() -> None:
    procs = os.environ["L2L_BENCH_CGROUPS"].split(":")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    with open(procs[rank], "w") as f:
        f.write(str(os.getpid()))
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
