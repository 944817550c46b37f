"""Where records come from: ``data.source``, ``data.sources`` and ``data.eval_source`` -> :class:`Source` (the
files in order, or a hub dataset; the record settings; the weight).

A source is a file, a folder (every data file under it, hidden files left out), a glob of shards, or a hub dataset
id (when no such path exists). All files of one source must have one file format, and all sources of a run one
kind of sample (text, or instruction records): the error names the odd file or source. :func:`settle_formats`
reads one record of each source to turn ``format: auto`` into the format found, so the planner knows whether
instruction samples will be packed before anything is tokenized.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
from dataclasses import dataclass, replace

from launcher.config.schema import Config, ConfigError, DataConfig, SourceConfig
from launcher.data.formats import INSTRUCTION, detect_format
from launcher.log import logger

FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
              ".arrow": "arrow"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class Source:
    key: str  # the config key that names it: data.source, data.sources[1].path, data.eval_source
    path: str  # as written
    files: tuple[str, ...]  # absolute paths in record order (empty for a hub dataset)
    builder: str  # datasets builder: json, csv, parquet, text, arrow; 'hub' for a hub dataset
    format: str  # a record format, or auto until settled
    text_field: str
    prompt_field: str
    response_field: str
    weight: float = 1.0
    name: str = ""  # hub configuration
    split: str = "train"  # hub split

    @property
    def label(self) -> str:
        """How messages name it: ``data.sources[1].path 'shards/'``."""
        return f"{self.key} {self.path!r}"

    @property
    def short(self) -> str:
        """A short name for log lines."""
        return os.path.basename(self.path.rstrip("/")) or self.path


def _exts() -> str:
    return ", ".join(e[1:] for e in FILE_TYPES)


def expand(path: str, key: str) -> tuple[tuple[str, ...], str]:
    """(files, builder) of a path, folder or glob; ((), 'hub') for a hub dataset id. ConfigError when none fits."""
    full = os.path.abspath(os.path.expanduser(path))
    ignored: list[str] = []
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(full, recursive=True) if os.path.isfile(f))
        if not files:
            raise ConfigError([f"{key}: {path!r} matches no file (looked for {full}); rule: a glob of data files; fix: "
                               "check the pattern"], "data")
        what = "the glob"
    elif os.path.isdir(full):
        files = []
        for root, dirs, names in os.walk(full):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in sorted(names):
                if n.startswith("."):
                    continue
                (files if os.path.splitext(n)[1].lower() in FILE_TYPES else ignored).append(os.path.join(root, n))
        if not files:
            raise ConfigError([f"{key}: the folder {path!r} holds no data files; rule: files ending in {_exts()}; fix: "
                               "point at the folder that holds them"], "data")
        what = "the folder"
    elif os.path.isfile(full):
        files, what = [full], "the file"
    elif _HUB_ID.fullmatch(path) and os.path.splitext(path)[1].lower() not in FILE_TYPES:
        return (), "hub"
    else:
        raise ConfigError([f"{key}: {path!r} not found (looked for {full}); rule: 'synthetic', an existing data file "
                           f"({_exts()}), a folder or glob of them, or a hub dataset id; fix: check the path (relative "
                           f"paths start from {os.getcwd()})"], "data")
    if ignored:
        logger.info(f"{key}: {len(ignored)} file(s) in {path} that are not data left out: "
                    + ", ".join(os.path.relpath(f, full) for f in ignored[:5]) + (" ..." if len(ignored) > 5 else ""))
    kinds: dict[str, list[str]] = {}
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        if ext not in FILE_TYPES:
            raise ConfigError([f"{key}: {f} in {what} {path!r} has extension {ext or '(none)'!r}; "
                               f"rule: one of {_exts()}; fix: convert the file or rename it to the extension of its "
                               "format"], "data")
        kinds.setdefault(FILE_TYPES[ext], []).append(f)
    if len(kinds) > 1:
        main = max(kinds, key=lambda k: len(kinds[k]))
        odd = [f for k, v in kinds.items() if k != main for f in v]
        counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
        raise ConfigError([f"{key}: {what} {path!r} mixes file formats ({counts}): {', '.join(odd[:3])}"
                           f"{' ...' if len(odd) > 3 else ''} differ from the other {main} files; rule: one source holds "
                           "one file format; fix: move them out, or list them as their own entry of data.sources"],
                          "data")
    for f in files:
        if os.path.getsize(f) == 0:
            raise ConfigError([f"{key}: {f} is empty (0 bytes); rule: every data file holds at least one record; fix: "
                               "delete it, or write the records into it"], "data")
    return tuple(files), next(iter(kinds))


def _source(key: str, path: str, fmt: str, d: DataConfig, s: SourceConfig | None = None) -> Source:
    files, builder = expand(path, key)
    return Source(key=key, path=path, files=files, builder=builder, format=fmt,
                  text_field=(s.text_field if s and s.text_field else d.text_field),
                  prompt_field=(s.prompt_field if s and s.prompt_field else d.prompt_field),
                  response_field=(s.response_field if s and s.response_field else d.response_field),
                  weight=s.weight if s else 1.0, name=s.name if s else "", split=s.split if s else "train")


def train_sources(cfg: Config) -> list[Source]:
    """The sources training samples come from (none for the synthetic task); weight-0 sources left out."""
    d = cfg.data
    if d.sources:
        return [_source(f"data.sources[{i}].path", s.path, s.format if s.format != "auto" else d.format, d, s)
                for i, s in enumerate(d.sources) if s.weight > 0]
    if d.source == "synthetic":
        return []
    return [_source("data.source", d.source, d.format, d)]


def eval_sources(cfg: Config) -> list[Source]:
    d = cfg.data
    return [_source("data.eval_source", d.eval_source, d.format, d)] if d.eval_source else []


# ----------------------------------------------------------------------------------------------
# One record's fields, to settle format: auto


_HUB: dict = {}  # (id, name, split) -> dataset: asked for its fields, its fingerprint and its records once


def load_hub(src: Source):
    """A hub dataset through ``load_dataset`` (name, config, split); a ConfigError when it cannot be had."""
    import datasets

    key = (src.path, src.name, src.split)
    try:
        if key not in _HUB:
            _HUB.clear()  # one at a time: a dataset object is small, but keeps its Arrow files open
            _HUB[key] = datasets.load_dataset(src.path, src.name or None, split=src.split)
        return _HUB[key]
    except Exception as e:  # noqa: BLE001 (network, auth and missing-dataset errors have many types)
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ConfigError([f"{src.label}: not a local file or folder (looked for {os.path.abspath(src.path)}), and "
                           f"the hub dataset could not be loaded ({type(e).__name__}: {msg}); rule: a path that exists, "
                           "or a hub dataset id reachable from here; fix: check the path, or download the dataset where "
                           "the network allows and point the source at its files"], "data") from None


def first_fields(src: Source, encoding: str) -> list[str]:
    """The field names of the first record of ``src`` (reads one record, or a parquet/arrow schema)."""
    f = src.files[0] if src.files else None
    if src.builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(f).names)
        except Exception as e:  # noqa: BLE001 (pyarrow raises several types for a damaged file)
            raise ConfigError([f"{src.label}: {f} is not a readable parquet file ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200]}); rule: every shard parses; fix: re-export or remove "
                               "that shard"], "data") from None
    if src.builder == "arrow":
        import pyarrow as pa

        try:
            with pa.memory_map(f) as mm:
                return list(pa.ipc.open_stream(mm).schema.names)
        except Exception as e:  # noqa: BLE001
            raise ConfigError([f"{src.label}: {f} is not an Arrow stream file, as datasets writes them "
                               f"({type(e).__name__}); rule: every shard parses; fix: re-export it with datasets "
                               "(Dataset.save_to_disk writes them)"], "data") from None
    if src.builder == "text":
        return ["text"]
    if src.builder == "hub":
        return list(load_hub(src).column_names)
    try:
        with open(f, encoding=encoding, newline="") as fh:
            if src.builder == "csv":
                return next(csv.reader(fh), [])
            head = fh.read(1 << 16)
            if head.lstrip().startswith("[") and f.endswith(".json"):
                fh.seek(0)
                recs = json.load(fh)
                return list(recs[0]) if recs and isinstance(recs[0], dict) else []
            fh.seek(0)
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    return list(rec) if isinstance(rec, dict) else []
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError):
        return []  # the full read names the problem with its line (files.diagnose)
    return []


def kind_of(fmt: str) -> str:
    return "instruction" if fmt in INSTRUCTION else "text"


def settle(sources: list[Source], encoding: str) -> list[Source]:
    """Sources with ``format`` auto replaced by the format of their first record, one kind of sample for all."""
    out = []
    for s in sources:
        fmt = s.format
        if fmt == "auto":
            fields = first_fields(s, encoding)
            if not fields:
                out.append(s)  # unreadable or empty: the full read says why, with the line
                continue
            fmt = detect_format("auto", fields, s.label, s.text_field, s.prompt_field, s.response_field)
        out.append(replace(s, format=fmt))
    kinds = {kind_of(s.format) for s in out if s.format != "auto"}
    if len(kinds) > 1:
        text = [s for s in out if kind_of(s.format) == "text"]
        inst = [s for s in out if s.format != "auto" and kind_of(s.format) == "instruction"]
        odd = text if len(text) <= len(inst) else inst
        rest = inst if odd is text else text
        raise ConfigError([f"{odd[0].label}: format {odd[0].format} differs from {rest[0].label} ({rest[0].format}); "
                           "rule: the sources of one run give one kind of sample: text (every token trained, packed "
                           "as one stream) or instruction records (prompt masked); fix: convert that source's records, "
                           "or train on the two kinds in separate runs"], "data")
    return out


def settle_formats(cfg: Config) -> Config:
    """``cfg`` with every ``format: auto`` of its data sources replaced by the format their records have.

    Reads one record per source (a parquet or arrow schema, a csv header, a json line). The planner then knows
    whether instruction samples will be packed (a block-diagonal attention mask) before anything is tokenized;
    the resolved formats are what ``config.yaml`` of the run records.
    """
    if cfg.task != "causal_lm":  # preference pairs have one layout (launcher.data.preference)
        return cfg
    d = cfg.data
    if d.sources:
        live = {s.path: s for s in settle(train_sources(cfg), d.encoding)}
        new = [replace(s, format=live[s.path].format) if s.path in live and s.weight > 0 else s for s in d.sources]
        d = replace(d, sources=new)
    elif d.source != "synthetic":
        (s,) = settle(train_sources(cfg), d.encoding)
        d = replace(d, format=s.format)
    if cfg.data.eval_source:
        (e,) = settle(eval_sources(cfg), d.encoding)
        kinds = {kind_of(s.format) for s in settle(train_sources(replace(cfg, data=d)), d.encoding)}
        if e.format != "auto" and kinds and kind_of(e.format) not in kinds:
            raise ConfigError([f"{e.label}: format {e.format} is not the kind of sample the training sources give "
                               f"({kinds.pop()}); rule: eval measures the loss training minimises; fix: an eval source "
                               "of the same kind"], "data")
    return replace(cfg, data=d)
