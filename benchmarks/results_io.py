"""What every benchmark script does last: the rows as JSON, their table as Markdown."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(rows: list[dict], json_out: str, table: str) -> None:
    """``rows`` to ``json_out``, ``table`` beside it (.md), and the table printed."""
    out = Path(json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    md = out.with_suffix(".md")
    md.write_text(table)
    print(f"\n{table}\nwrote {out}, {md}")
