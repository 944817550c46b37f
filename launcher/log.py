"""Everything vramfit says while it works goes through ``logging.getLogger("vramfit")``.

- Lines read ``[vramfit] message`` (warnings: ``[vramfit] warning: message``) and go to stderr: stdout
  is for results (the plan table, ``--json`` documents), so ``vramfit plan --json | jq`` always works.
- Only rank 0 speaks; a record logged with ``extra={"all_ranks": True}`` is printed by every rank.
- While a tqdm progress bar is up, lines are written through ``tqdm.write`` so they do not tear it.
- ``log.level`` (debug, info, warning, error) sets the level; :func:`setup` is idempotent.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vramfit")

LEVELS = ("debug", "info", "warning", "error")


class RankFilter(logging.Filter):
    """Pass records on rank 0, and records marked ``all_ranks`` on every rank."""

    def __init__(self, rank: int = 0):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or bool(getattr(record, "all_ranks", False))


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.ERROR:
            msg = f"error: {msg}"
        elif record.levelno >= logging.WARNING:
            msg = f"warning: {msg}"
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"[vramfit] {msg}"


class TqdmHandler(logging.Handler):
    """Writes to the stderr of the moment (so pytest's capture and redirections see it), through
    ``tqdm.write`` while a tqdm bar is open."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            stream = sys.stderr
            bars = _open_bars()
            if bars:
                from tqdm import tqdm

                tqdm.write(msg, file=stream)
            else:
                stream.write(msg + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 -- logging must never take the run down (logging's own rule)
            self.handleError(record)


def _open_bars() -> bool:
    tqdm_mod = sys.modules.get("tqdm")
    instances = getattr(getattr(tqdm_mod, "tqdm", None), "_instances", None)
    return bool(instances)


_handler: TqdmHandler | None = None
_filter = RankFilter(0)


def setup(level: str = "info", rank: int | None = None) -> logging.Logger:
    """Attach vramfit's handler once; set the level and the rank whose records are printed."""
    global _handler
    if _handler is None:
        _handler = TqdmHandler()
        _handler.setFormatter(_Formatter())
        _handler.addFilter(_filter)
        logger.addHandler(_handler)
        logger.propagate = False  # one line per record, whatever the application's root logger does
    if rank is not None:
        _filter.rank = rank
    # bitsandbytes warns at import, on every CPU with AVX512-BF16, that an optional kernels package for its
    # 4-bit inference layout is missing: vramfit never uses that layout (launcher/model/quantize.py), so the line
    # only alarms people
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logger.setLevel(level.upper())
    return logger


setup()  # a library user who never calls setup still gets rank-0 lines on stderr
