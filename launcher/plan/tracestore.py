"""The planner's traces kept on disk, so that planning a model again costs no tracing.

Planning a large model is mostly tracing: each setting the search prices (precision, micro-batch 2 and 3,
checkpointing, chunked loss, activation offload, attention kernel) is a forward and backward of a few
decoder layers on the meta device, a fifth of a second each for a 7B Llama, and ``vramfit plan
--compare-gpus`` needs a hundred and more. A trace depends only on its key (the model config, the depth, the
trace settings) and on the code that made it, so :class:`TraceStore` keeps each one in a gzip'd JSON file
under ``cache_root()/traces``, named by a hash of the key and of everything that could change the result:
vramfit's own source, torch's, transformers' and peft's versions. A later ``plan``, ``train``, ``tune`` or
``bench`` of the same model reads them back (about a millisecond each), and with them what the plan derives
from the model's meta copies (its parameter counts, whether its loss can be chunked), so that a plan whose
traces are all kept builds no model. A file that does not read back, or holds another key, is ignored and
replaced; a cache that cannot be written never stops a plan.
``VRAMFIT_TRACE_CACHE=off`` turns it off. The oldest files go when there are more than ``MAX_FILES``.

The store is installed by the command line (:func:`install`); :mod:`launcher.plan.memory` itself does no I/O.
``vramfit plan`` also traces in several processes (:func:`workers`, ``VRAMFIT_TRACE_WORKERS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import zlib
from collections import Counter
from importlib import metadata

from launcher.config.schema import ConfigError
from launcher.machine.files import write_atomic
from launcher.paths import cache_root
from launcher.plan.memory import estimate, shape
from launcher.plan.memory.trace import StepTrace

FORMAT = 2  # bump when the file's layout changes
MAX_FILES = 4000  # a few KB each: MBs at most
_FIELDS = [f.name for f in dataclasses.fields(StepTrace) if f.name != "ops"]  # ops is op_list counted


def code_version() -> str:
    """A hash of vramfit's source and the versions of the libraries a trace runs through."""
    h = hashlib.sha256(f"format {FORMAT}".encode())
    for dist in ("torch", "transformers", "peft"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            h.update(f"{dist} {metadata.version(dist)}".encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the whole package: its code is the trace
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                h.update(os.path.relpath(os.path.join(folder, name), root).encode())
                with open(os.path.join(folder, name), "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def encode(t: StepTrace) -> dict:
    """The trace as JSON values; its op list as the distinct ops and an index per op (a step's thousand-odd ops
    are a few dozen distinct ones: a file a tenth the size, read back several times faster)."""
    d = {name: getattr(t, name) for name in _FIELDS if name != "op_list"}
    index: dict = {}
    d["op_index"] = [index.setdefault(op, len(index)) for op in t.op_list]
    d["op_kinds"] = list(index)
    return d


def decode(d: dict) -> StepTrace:
    fields = {name: d[name] for name in _FIELDS if name != "op_list"}
    kinds = [tuple(op) for op in d["op_kinds"]]
    fields["op_list"] = [kinds[i] for i in d["op_index"]]
    return StepTrace(**fields, ops=dict(Counter(fields["op_list"])))


class TraceStore:
    def __init__(self, directory: str | None = None):
        self.dir = directory or os.path.join(cache_root(), "traces")
        self.version = code_version()
        self.hits = self.writes = 0

    def _path(self, key) -> tuple[str, str]:
        text = repr(key)
        return os.path.join(self.dir, hashlib.sha256(f"{self.version}\n{text}".encode()).hexdigest()[:40] + ".json.gz"), text

    def _read(self, key) -> dict | None:
        path, text = self._path(key)
        try:
            with open(path, "rb") as fh:
                d = json.loads(gzip.decompress(fh.read()))
            if not isinstance(d, dict) or d.get("key") != text or d.get("version") != self.version:
                return None
            return d
        except FileNotFoundError:
            return None
        except (OSError, EOFError, zlib.error, ValueError):  # damaged: made again, rewritten
            return None

    def _write(self, key, payload: dict) -> None:
        path, text = self._path(key)
        try:
            os.makedirs(self.dir, exist_ok=True)
            # json.dumps, not json.dump: dump streams through the pure-Python encoder, six times slower here
            text_out = json.dumps({"key": text, "version": self.version, **payload})
            write_atomic(path, gzip.compress(text_out.encode(), compresslevel=6), fsync=False)  # a cache
            self.writes += 1
            if self.writes % 64 == 1:
                self.prune()
        except OSError:  # a full or read-only cache folder: this process keeps what it made in memory
            pass

    def get(self, key) -> StepTrace | None:
        d = self._read(key)
        try:
            out = decode(d["trace"]) if d is not None else None
        except (KeyError, TypeError, ValueError, IndexError):  # damaged: traced again, rewritten
            return None
        if out is not None:
            self.hits += 1
        return out

    def put(self, key, t: StepTrace) -> None:
        self._write(key, {"trace": encode(t)})

    def get_value(self, key) -> dict | None:
        """A JSON object kept with :meth:`put_value` (what a plan derives from a model besides its traces)."""
        d = self._read(key)
        value = d.get("value") if d is not None else None
        if not isinstance(value, dict):
            return None
        self.hits += 1
        return value

    def put_value(self, key, value: dict) -> None:
        self._write(key, {"value": value})

    def prune(self) -> None:
        """Remove the oldest files beyond ``MAX_FILES`` (and temporary files of killed writers)."""
        with contextlib.suppress(OSError):
            entries = [e for e in os.scandir(self.dir) if e.is_file()]
            stale = [e for e in entries if e.name.endswith(".tmp")]
            kept = sorted((e for e in entries if e.name.endswith(".json.gz")), key=lambda e: e.stat().st_mtime)
            for e in stale + kept[:max(0, len(kept) - MAX_FILES)]:
                with contextlib.suppress(OSError):
                    os.remove(e.path)


def install() -> TraceStore | None:
    """Keep this process's traces on disk (unless ``VRAMFIT_TRACE_CACHE=off``)."""
    if os.environ.get("VRAMFIT_TRACE_CACHE", "").lower() in ("off", "0", "false", "no"):
        estimate.set_store(None)
        shape.set_store(None)
        return None
    store = TraceStore()
    estimate.set_store(store)
    shape.set_store(store)
    return store


def workers() -> int:
    """Processes ``vramfit plan`` traces in (:func:`launcher.plan.memory.estimate.parallel`): ``VRAMFIT_TRACE_WORKERS``,
    else this machine's cores up to 4 (a plan's estimates need at most four traces at once); 1 or 0 traces in
    the planning process itself."""
    text = os.environ.get("VRAMFIT_TRACE_WORKERS", "").strip()
    if not text:
        return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError([f"VRAMFIT_TRACE_WORKERS: got {text!r}; rule: a whole number of processes, 0 or more; fix: "
                           "VRAMFIT_TRACE_WORKERS=2, or 0 to trace in the planning process"], "environment")
    return n
