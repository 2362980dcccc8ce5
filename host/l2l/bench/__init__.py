"""``l2l bench``: the benchmarks, one module each, and the suite that runs the main three.

relay (step time against the plain baseline), eps (update throughput against the
memory roofline), memory (device memory against depth and M, ledger and audit),
workers (1, 2, 4 relay workers on one EPS), load (host memory of loading a
Hugging Face checkpoint into the EPS, and two training steps after it), host (peak
resident set of whole training runs against the planner's host figure), offload (the EPS disk tier under a memory limit: peak
resident set against the state, its disk throughput against the disk's), shard (the EPS
across machines: each rank's peak resident set at R = 1, 2, 4, capacity under a limit per
rank, the sharded step's cost against replicated), suite (eps, relay and memory, with the
headline figures, and ``docs/results.md`` regenerated).
"""
from __future__ import annotations

from ..errors import UserError

BENCHMARKS = ("relay", "eps", "memory", "workers", "load", "host", "offload", "shard", "suite")


def run_bench(what: str, argv: list[str]) -> int:
    if what == "relay":
        from .relay import run_relay_bench
        run_relay_bench(argv)
    elif what == "eps":
        from .eps import run_eps_bench
        return run_eps_bench(argv)
    elif what == "memory":
        from .memory import run_memory_bench
        run_memory_bench(argv)
    elif what == "workers":
        from .workers import run_workers_bench
        return run_workers_bench(argv)
    elif what == "load":
        from .load import run_load_bench
        return run_load_bench(argv)
    elif what == "host":
        from .host import run_host_bench
        return run_host_bench(argv)
    elif what == "offload":
        from .offload import run_offload_bench
        return run_offload_bench(argv)
    elif what == "shard":
        from .shard import run_shard_bench
        return run_shard_bench(argv)
    elif what == "suite":
        from .suite import run_suite
        return run_suite(argv)
    else:
        raise UserError(f"unknown benchmark {what!r}; available: {', '.join(BENCHMARKS)}")
    return 0
