"""Numbers and lists written for prose: what the chapters and the recorded summaries print."""

from __future__ import annotations

import math
from collections.abc import Iterable


def significant(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in fixed notation with thousands separators (1,234; 73.9; 0.0984)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}" if not math.isfinite(x) else "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{round(x, decimals):,.{decimals}f}"


def listing(items: Iterable[str]) -> str:
    """Items joined for prose: "a", "a and b", "a, b and c"."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


def change(delta: float, digits: int = 2, unit: str = "") -> str:
    """A signed change for prose: "falls by 0.07 nats", "rises by 0.07 nats" or "does not change" (below the
    last digit shown)."""
    shown = f"{abs(delta):.{digits}f}"
    if float(shown) == 0:
        return "does not change"
    return f"{'rises' if delta > 0 else 'falls'} by {shown}" + (f" {unit}" if unit else "")


def times(count: float) -> str:
    """A count of repeats in words: "once", "twice", "2.5 times"."""
    return {1: "once", 2: "twice"}.get(count, f"{count:g} times")
