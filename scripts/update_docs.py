#!/usr/bin/env python3
"""Rewrite the option tables in README.md and docs/ from the declarations in eaglet.options.

A table is the text between `<!-- options: STAGE -->` and `<!-- /options -->`;
tests/test_options.py fails when one is stale, and this script brings them up to date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eaglet.options import STAGES, markdown_table  # noqa: E402

# The markers, and between them the table (or nothing yet: a new page's two marker lines).
TABLE = re.compile(r"(<!-- options: (\w+) -->)\n((?:(?!<!-- /?options)[\s\S])*?)\n?(<!-- /options -->)")


def update(text: str) -> str:
    return TABLE.sub(lambda m: f"{m[1]}\n{markdown_table(STAGES[m[2]])}\n{m[4]}", text)


def main() -> int:
    changed = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        new = update(text)
        if new != text:
            page.write_text(new)
            changed += 1
            print(f"updated {page.relative_to(ROOT)}")
    print(f"{changed} page(s) updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
