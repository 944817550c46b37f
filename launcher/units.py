"""Byte units and their formatters, shared by every module (the planner's tables, the loop's lines, bench)."""

from __future__ import annotations

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def gib(n: float | None, digits: int = 1) -> str:
    """'15.4 GiB' ('-' for None)."""
    return "-" if n is None else f"{n / GiB:.{digits}f} GiB"


def gib_short(n: float | None) -> str:
    """'0.50G': the compact form of progress lines ('-' for None)."""
    return "-" if n is None else f"{n / GiB:.2f}G"


def mib(n: float | None, digits: int = 0) -> str:
    return "-" if n is None else f"{n / MiB:.{digits}f} MiB"
