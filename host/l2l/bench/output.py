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
