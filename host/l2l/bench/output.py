"""Where a benchmark's results go: JSON for machines, Markdown for people, both in one folder."""
from __future__ import annotations

import json
from pathlib import Path


def save_results(folder: str | Path, stem: str, result: dict, table: str) -> None:
    """Write ``stem.json`` and ``stem.md`` under ``folder`` and print the table."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(table)
    print("\n" + table)


def publish(args, stem: str, result: dict, table: str, *, begin: str, end: str) -> None:
    """:func:`save_results` under ``args.out``, then the table regenerated between ``begin``
    and ``end`` in ``args.results`` (default: docs/results.md when it exists here, never
    with ``args.quick``): what a benchmark with a section of its own in results.md does."""
    save_results(args.out, stem, result, table)
    results = args.results if args.results is not None else ("" if args.quick else "docs/results.md")
    if results and Path(results).exists():
        from .suite import regenerate_section  # the suite imports the benchmarks
        regenerate_section(Path(results), table, begin=begin, end=end)
