"""Figures as people read them: bytes, FLOPs, seconds and rates, each formatted once, and the
unit of a figure in the workbench's JSON (its key ends with it).

Entry points: `format_bytes`, `format_flops`, `format_seconds`, `format_count`,
`byte_ticks` and `second_ticks` (axis ticks), `unit_of(key, parent)` and
`format_value(key, value, parent)`, which the CLI's human output, the pictures, the
explorer and graph trainer's activation log all call.
"""

from __future__ import annotations

import math
from typing import Any, Literal

__all__ = [
    "Unit",
    "byte_ticks",
    "format_bytes",
    "format_count",
    "format_flops",
    "format_seconds",
    "format_value",
    "second_ticks",
    "unit_of",
]

Unit = Literal["bytes", "seconds", "flops", "tokens_per_second"]
# A JSON figure's key names its unit as one of its words (`peak_bytes`, `saved_bytes_before`,
# `step_seconds`, `recompute_flops_delta`, `tokens_per_second`); a map of figures takes the
# unit of the key it sits under (`step_seconds: {h100: ...}`), and these maps are bytes by
# what they break down.
_WORDS: dict[str, Unit] = {"bytes": "bytes", "seconds": "seconds", "flops": "flops"}
_RATE: Unit = "tokens_per_second"
_BYTE_MAPS = ("peak_breakdown", "saved_by_layer", "host_by_layer")
MINUS = "−"  # U+2212: a negative figure's sign, as the pictures print it


def format_bytes(n: float, digits: int = 1) -> str:
    """Binary units, as memory is counted (1 MiB = 1024 KiB); `digits` after the point
    (graph trainer's activation log prints 2).

    >>> format_bytes(512), format_bytes(3 * 2**19), format_bytes(3 * 2**19, 2)
    ('512 B', '1.5 MiB', '1.50 MiB')
    >>> format_bytes(-2**31)
    '−2.0 GiB'
    """
    sign = MINUS if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def byte_ticks(lo: float, hi: float, most: int = 4) -> list[tuple[int, str]]:
    """Axis ticks spanning [lo, hi] at round values of one binary unit (the one
    `format_bytes` gives `hi`), each with its text in that unit: 100, 120, 140 MiB rather
    than round byte counts that read 95.4, 114.4, 133.5 MiB. At most `most` ticks.

    >>> [text for _, text in byte_ticks(95.4 * 2**20, 143.1 * 2**20)]
    ['100 MiB', '120 MiB', '140 MiB']
    >>> byte_ticks(2**30, 2.2 * 2**30)
    [(1073741824, '1.0 GiB'), (1610612736, '1.5 GiB'), (2147483648, '2.0 GiB')]
    """
    unit = format_bytes(max(abs(lo), abs(hi))).split()[-1]
    scale = 1024 ** ("B", "KiB", "MiB", "GiB").index(unit)
    low, high = lo / scale, hi / scale
    if not _spans(low, high):
        return [(round(lo), f"{low:g} {unit}")]
    values = _round_steps(low, high, most, 1.0 if unit == "B" else 0.0)
    digits = _decimals(values)  # as few decimals as show every tick exactly
    return [(round(v * scale), f"{v:.{digits}f} {unit}") for v in values]


def _spans(low: float, high: float) -> bool:
    """Whether [low, high] is wider than rounding error (two figures of one step that differ
    in their last bits get one tick, not ticks a billionth apart)."""
    return high - low > 1e-9 * max(abs(low), abs(high))


def _round_steps(low: float, high: float, most: int, least: float = 0.0) -> list[float]:
    """At most `most` round values (1, 2, 2.5, 5 times a power of ten, at least `least`
    apart) spanning [low, high]."""

    def count(step: float) -> int:
        return math.floor(high / step + 1e-9) - math.ceil(low / step - 1e-9) + 1

    magnitude = 10 ** math.floor(math.log10((high - low) / most))
    steps = [m * magnitude * 10**e for e in (0, 1, 2) for m in (1, 2, 2.5, 5)]
    step = next(s for s in steps if count(s) <= most and s >= least)
    first = math.ceil(low / step - 1e-9)
    return [k * step for k in range(first, first + count(step))]


def _decimals(values: list[float]) -> int:
    """As few decimals as show every value exactly, the same for all."""
    return next(d for d in range(6) if all(abs(round(v, d) - v) < 1e-9 for v in values))


def second_ticks(lo: float, hi: float, most: int = 4) -> list[tuple[float, str]]:
    """Axis ticks spanning [lo, hi] seconds at round values of one unit (the one
    `format_seconds` gives the larger end: µs, ms or s), each with its text in that unit, with
    as many decimals as tell them apart: never `1.34 s, 1.34 s, 1.35 s`.

    >>> [text for _, text in second_ticks(1.3352, 1.3518)]
    ['1.340 s', '1.345 s', '1.350 s']
    >>> [text for _, text in second_ticks(0.0102, 0.0131)]
    ['11 ms', '12 ms', '13 ms']
    >>> [text for _, text in second_ticks(0.06295455373797687, 0.06295455373797688)]
    ['62.9546 ms']
    """
    unit, scale = ("µs", 1e-6) if max(abs(lo), abs(hi)) < 1e-3 else ("ms", 1e-3)
    if max(abs(lo), abs(hi)) >= 1:
        unit, scale = "s", 1.0
    low, high = lo / scale, hi / scale
    if not _spans(low, high):
        return [(lo, f"{low:g} {unit}")]
    values = _round_steps(low, high, most)
    digits = _decimals(values)
    return [(v * scale, f"{v:,.{digits}f} {unit}") for v in values]


def format_count(n: int, word: str, plural: str = "") -> str:
    """`n` things, in the singular for one.

    >>> format_count(1, "microbatch", "microbatches"), format_count(3, "selector")
    ('1 microbatch', '3 selectors')
    """
    return f"{n} {word if n == 1 else plural or word + 's'}"


def format_flops(n: float) -> str:
    """Decimal units (1 GFLOP = 1e9 FLOP).

    >>> format_flops(2.5e12), format_flops(12)
    ('2.5 TFLOP', '12 FLOP')
    """
    sign = MINUS if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n:.0f} FLOP"


def format_seconds(s: float) -> str:
    """µs below a millisecond, ms below a second, s above.

    >>> format_seconds(2.5e-5), format_seconds(0.0123), format_seconds(6.4488)
    ('25.0 µs', '12.30 ms', '6.45 s')
    """
    if abs(s) < 1e-3:
        return f"{s * 1e6:,.1f} µs"
    return f"{s * 1e3:,.2f} ms" if abs(s) < 1 else f"{s:,.2f} s"


def unit_of(key: str, parent: str = "") -> Unit | None:
    """The unit of the figure at `key` (under the map `parent`), or None for a count.

    >>> unit_of("peak_bytes"), unit_of("h100", "step_seconds"), unit_of("mlp", "peak_breakdown")
    ('bytes', 'seconds', 'bytes')
    >>> unit_of("bytes_no_longer_saved"), unit_of("recompute_flops_delta")
    ('bytes', 'flops')
    >>> unit_of("nodes") is None
    True
    """
    for name in (key, parent):
        if _RATE in name:
            return _RATE
        for word in name.split("_"):
            if word in _WORDS:
                return _WORDS[word]
    if parent in _BYTE_MAPS:
        return "bytes"
    return None


def format_value(key: str, value: Any, parent: str = "") -> str | None:
    """A number with the unit `unit_of` gives it; None when it has none (a count).

    >>> format_value("peak_bytes", 3 * 2**20), format_value("tokens_per_second", 9569.2)
    ('3.0 MiB', '9,569 tokens/s')
    """
    unit = unit_of(key, parent)
    if unit == "bytes":
        return format_bytes(value)
    if unit == "seconds":
        return format_seconds(value)
    if unit == "flops":
        return format_flops(value)
    if unit == "tokens_per_second":
        return f"{value:,.0f} tokens/s"
    return None
