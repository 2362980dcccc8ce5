"""Where a benchmark's results go: JSON for machines, Markdown for people, both in one folder."""
from __future__ import annotations

import json
from pathlib import Path


def add_output_options(p, begin: str, end: str) -> None:
    """``--out`` and ``--results``, as every benchmark with a section of its own in results.md
    takes them (:func:`publish`)."""
    p.add_argument("--out", default="bench/results")
    p.add_argument("--results", default=None,
                   help=f"Markdown file whose section between {begin} and {end} is regenerated "
                        "(default: docs/results.md when it exists here, not with --quick)")


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
        regenerate_section(Path(results), table, begin=begin, end=end)


def regenerate_section(path: Path, block: str, *, begin: str, end: str) -> None:
    """Replace the text between the markers ``begin`` and ``end`` in ``path`` with ``block``
    (appended, with the markers, when the file has none); everything else stays."""
    text = path.read_text() if path.exists() else ""
    fresh = f"{begin}\n{block.strip()}\n{end}"
    if begin in text and end in text.split(begin, 1)[1]:
        before, rest = text.split(begin, 1)
        text = before + fresh + rest.split(end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + fresh + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
