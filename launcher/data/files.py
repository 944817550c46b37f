"""A :class:`~launcher.data.sources.Source` -> a ``datasets.Dataset`` of records (memory-mapped Arrow), and every way
that can fail named: which shard, which line, which byte, the rule and the fix.

``load_dataset`` does the reading (json, csv, parquet, text by paragraph, arrow; ``data.encoding`` for the text
formats). When it fails, :func:`diagnose` looks at each shard on its own (empty, not in the encoding, a JSON
line that does not parse, a parquet file that does not open, fields that differ from the first shard) so the
error names the shard and the line instead of a pyarrow traceback. :func:`locate` turns a record number back
into a file and a line, for the records dropped as invalid.
"""

from __future__ import annotations

import codecs
import csv
import json
import os

from launcher.config.schema import ConfigError
from launcher.data.sources import Source, load_hub


def show(path: str) -> str:
    """A path as messages print it: relative to the working directory when under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# ----------------------------------------------------------------------------------------------
# Reading


def read_records(src: Source, encoding: str, cache_dir: str, num_proc: int = 1):
    """The source's records as one ``datasets.Dataset`` (row i = record i of the files in order)."""
    import datasets

    if src.builder == "hub":
        return load_hub(src)
    for f in src.files:
        if f.endswith(".json"):
            problem = _json_problem(f, src, encoding)
            if problem:
                raise ConfigError([problem], "data")
    kwargs = {}
    if src.builder == "text":
        kwargs = {"sample_by": "paragraph", "encoding": encoding}
    elif src.builder in ("json", "csv"):
        kwargs = {"encoding": encoding}
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error lines would repeat ours
    try:
        return datasets.load_dataset(src.builder, data_files=list(src.files), split="train", cache_dir=cache_dir,
                                     num_proc=min(num_proc, len(src.files)) if num_proc > 1 and len(src.files) > 1
                                     else None, **kwargs)
    except Exception as e:  # noqa: BLE001 (pyarrow/pandas raise many types; the shard and cause are named below)
        raise read_error(src, encoding, e) from None
    finally:
        datasets.logging.set_verbosity(level)


def read_error(src: Source, encoding: str, e: BaseException) -> ConfigError:
    """The precise problem behind a failed read (which shard, which line), else the library's own message."""
    problem = diagnose(src, encoding)
    if problem:
        return ConfigError([problem], "data")
    cause = e
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, StopIteration) or "corresponds to no data" in str(e):
        return ConfigError([f"{src.label} holds no records; rule: at least one; fix: check the file"], "data")
    text = str(cause).splitlines()[0][:300] if str(cause) else ""
    return ConfigError([f"{src.label} could not be read as {src.builder} ({type(cause).__name__}: {text}); rule: "
                        f"well-formed {src.builder} files; fix: correct the file"], "data")


# ----------------------------------------------------------------------------------------------
# Diagnosis, one shard at a time


def diagnose(src: Source, encoding: str) -> str | None:
    """The first problem found in the source's shards, as 'label: shard, line: what; rule; fix', or None."""
    first_fields = None
    for f in src.files:
        name = f if len(src.files) == 1 else f"shard {show(f)}"
        where = src.label if len(src.files) == 1 else f"{src.label} {name}"
        if os.path.getsize(f) == 0:
            return f"{where} is empty (0 bytes); rule: every data file holds at least one record; fix: delete it"
        if src.builder in ("json", "csv", "text"):
            bad = encoding_problem(f, encoding)
            if bad:
                return f"{where}: {bad}"
        if src.builder == "json":
            bad = _json_problem(f, src, encoding) if f.endswith(".json") else _first_bad_json_line(f, encoding)
            if bad:
                return bad if bad.startswith(src.key) else (f"{where} {bad}; rule: JSON lines hold one JSON object per "
                                                             "line; fix: correct that line (or delete it)")
        fields = None
        if src.builder == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(f)
                fields = list(pf.schema_arrow.names)
                for i in range(pf.num_row_groups):
                    pf.read_row_group(i, columns=fields[:1])
            except Exception as e:  # noqa: BLE001 (pyarrow raises several types for damaged files)
                return (f"{where} does not parse as parquet ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        "rule: every shard is a complete parquet file; fix: re-export that shard or remove it")
        elif src.builder == "csv":
            with open(f, encoding=encoding, newline="") as fh:
                fields = next(csv.reader(fh), [])
        elif src.builder == "json":
            fields = _json_fields(f, encoding)
        if fields is not None:
            if first_fields is None:
                first_fields = (fields, f)
            elif sorted(fields) != sorted(first_fields[0]):
                return (f"{where} has fields {fields}, but {show(first_fields[1])} has {first_fields[0]}; "
                        "rule: the shards of one source hold the same fields; fix: rename the fields of that shard, "
                        "or make it a separate entry of data.sources")
    return None


def encoding_problem(path: str, encoding: str, chunk: int = 1 << 20) -> str | None:
    """Where ``path`` stops decoding as ``encoding``: 'byte 0xE9 at line 3 (offset 41) is not valid utf-8 ...'."""
    dec = codecs.getincrementaldecoder(encoding)("strict")
    offset, lines = 0, 1
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                pos = max(0, e.start)
                at = offset + pos
                line = lines + block[:pos].count(b"\n")
                bad = block[pos:pos + 1]
                return (f"byte 0x{bad.hex().upper()} at line {line} (byte offset {at}) is not valid {encoding}; rule: "
                        f"text files are read as data.encoding ({encoding}); fix: data.encoding={_guess(path, at)}, or "
                        f"convert the file to UTF-8 (iconv -f {_guess(path, at)} -t utf-8)")
            if not block:
                return None
            offset += len(block)
            lines += block.count(b"\n")


def _guess(path: str, at: int) -> str:
    """The encoding a file that is not UTF-8 most likely has: UTF-16 by its byte-order mark, else cp1252 (Windows
    Western), else latin-1 (which decodes any byte)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(0, at - 2000))
        around = fh.read(4000)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    try:
        around.decode("cp1252")
        return "cp1252"
    except UnicodeDecodeError:
        return "latin-1"


def _first_bad_json_line(path: str, encoding: str) -> str | None:
    """'line N: <error>' for the first line of a JSON-lines file that does not parse (None if all do)."""
    with open(path, encoding=encoding, errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: {e.msg} at column {e.colno} ({line.strip()[:60]!r})"
            if not isinstance(rec, dict):
                return f"line {n}: a {type(rec).__name__}, not a JSON object ({line.strip()[:60]!r})"
    return None


def _json_fields(path: str, encoding: str) -> list[str] | None:
    with open(path, encoding=encoding, errors="replace") as fh:
        if path.endswith(".json") and fh.read(1 << 12).lstrip().startswith("["):
            return None  # an array: _json_problem has checked it whole
        fh.seek(0)
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                return sorted(rec) if isinstance(rec, dict) else None
    return None


def _json_problem(path: str, src: Source, encoding: str) -> str | None:
    """Why a .json file does not hold records (an array of objects, or JSON lines), or None if it does."""
    with open(path, encoding=encoding, errors="replace") as fh:
        text = fh.read()
    where = src.label if len(src.files) == 1 else f"{src.label} shard {show(path)}"
    if text.lstrip().startswith("["):
        try:
            recs = json.loads(text)
        except json.JSONDecodeError as e:
            return (f"{where} line {e.lineno}: {e.msg} at column {e.colno}; rule: a JSON array of objects, or one JSON "
                    "object per line; fix: correct that line")
        bad = next((i for i, r in enumerate(recs) if not isinstance(r, dict)), None)
        if bad is not None:
            return (f"{where} element {bad} of the array is a {type(recs[bad]).__name__}; rule: every record is a "
                    "JSON object; fix: wrap it as {\"text\": ...} or remove it")
        return None
    if text.lstrip().startswith("{") and "\n" in text.strip():
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines: checked line by line below
        if isinstance(whole, dict):
            lists = [k for k, v in whole.items() if isinstance(v, list)]
            target = f"the list under {lists[0]!r} " if lists else "the records "
            return (f"{where} holds one JSON object spread over several lines (keys: {', '.join(list(whole)[:8])}); "
                    f"rule: a JSON array of records, or one record per line; fix: save {target}as a top-level array "
                    "[...] or as JSON lines")
    bad = _first_bad_json_line(path, encoding)
    if bad:
        return f"{where} {bad}; rule: JSON lines hold one JSON object per line; fix: correct that line (or delete it)"
    return None


# ----------------------------------------------------------------------------------------------
# Record number -> file and line


def _records(path: str, builder: str, encoding: str) -> list[str]:
    """Where each record of one file starts, as 'line N' (or 'element N', 'row N')."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return [f"row {i + 1}" for i in range(pq.ParquetFile(path).metadata.num_rows)]
    if builder == "arrow":
        import pyarrow as pa

        with pa.memory_map(path) as mm:
            n = pa.ipc.open_stream(mm).read_all().num_rows
        return [f"row {i + 1}" for i in range(n)]
    with open(path, encoding=encoding, newline="") as fh:
        if builder == "csv":
            reader = csv.reader(fh)
            next(reader, None)
            out, line = [], reader.line_num + 1
            for _ in reader:
                out.append(f"line {line}")
                line = reader.line_num + 1
            return out
        if builder == "text":  # paragraphs: blocks separated by a blank line, as datasets' text builder cuts them
            out, line = [], 1
            for para in fh.read().split("\n\n"):
                if para:
                    out.append(f"line {line}")
                line += para.count("\n") + 2
            return out
        text = fh.read()
        if text.lstrip().startswith("[") and path.endswith(".json"):
            return [f"element {i}" for i in range(len(json.loads(text)))]
        return [f"line {n}" for n, ln in enumerate(text.split("\n"), 1) if ln.strip()]


def locate(src: Source, indices: list[int], encoding: str) -> dict[int, str]:
    """{record index: 'file line N'} for a few records of ``src`` (the files are read up to the last one)."""
    if src.builder == "hub":
        return {i: f"{src.path} ({src.split}) row {i + 1}" for i in indices}
    out, start = {}, 0
    want = sorted(set(indices))
    for f in src.files:
        if not want:
            break
        try:
            where = _records(f, src.builder, encoding)
        except (OSError, ValueError, UnicodeDecodeError):
            where = []
        while want and want[0] < start + len(where):
            i = want.pop(0)
            out[i] = f"{show(f)} {where[i - start]}"
        start += len(where)
    for i in want:
        out[i] = f"record {i + 1}"
    return out
