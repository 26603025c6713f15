"""`make lint`: no module under session/ longer than MAX_LINES lines (one concept per module; a file
that outgrows this is doing two jobs). Lists each one over, longest first, and exits 1; no dependencies.

    python scripts/check_file_sizes.py [root]    # root: the repository (default: this script's parent's)
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 450


def line_count(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def oversized(package: Path, max_lines: int = MAX_LINES) -> list[tuple[int, Path]]:
    """(lines, path) of every .py file under ``package`` longer than ``max_lines``, longest first."""
    counts = ((line_count(path), path) for path in package.rglob("*.py"))
    return sorted(((n, path) for n, path in counts if n > max_lines), key=lambda item: (-item[0], item[1]))


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    over = oversized(root / "session")
    for lines, path in over:
        print(f"{path.relative_to(root)}: {lines} lines (max {MAX_LINES})")
    if over:
        print(f"{len(over)} file(s) under session/ over {MAX_LINES} lines: split each by job")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
