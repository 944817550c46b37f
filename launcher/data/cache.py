"""Tokenized sources on disk: made once with ``Dataset.map``, memory-mapped by every later start and resume.

Layout: ``<cache_dir>/<data key>/<tokenizer key>/`` holds the Arrow files ``Dataset.map`` wrote and
``vramfit.json`` (the marker, written last: what was read, counts, the records dropped and why). The data key
hashes the files' contents (sha256, in order), the record settings (format, fields, chat template,
``train_on_prompt``, encoding) and :data:`CACHE_VERSION`; the tokenizer key hashes the tokenizer's full
serialisation. A cache is built under a temporary name and renamed into place when complete, so a killed
build or a full disk never leaves something that a later start would use; a lock file makes a second process
(another rank, another run) wait for the first one's build instead of repeating it.

Costs: one read of every file for its content hash (about 1 GB/s), remembered by the file's path, size, inode and
times so later starts read nothing whole (:func:`file_digest`); on the first start, a copy of the
records as Arrow (deleted when tokenized) and the token ids in the smallest integer type the vocabulary allows
(2 bytes per token below 65,536 ids) plus 1 bit per token for the loss mask of instruction records.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from launcher import paths
from launcher.config.schema import ConfigError
from launcher.data.files import diagnose, locate, read_records
from launcher.data.formats import INSTRUCTION, detect_format, id_dtype, tokenize_batch
from launcher.data.sources import Source
from launcher.log import logger
from launcher.machine.files import is_disk_full, write_atomic

CACHE_VERSION = 1  # bump when what a cache holds changes meaning
MARKER = "vramfit.json"
LOCATED = 20  # dropped records located per source (file and line), kept in the marker


def cache_root(cache_dir: str) -> str:
    if cache_dir != "auto":
        return os.path.abspath(os.path.expanduser(cache_dir))
    return os.path.join(paths.cache_root(), "data")


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_digest(path: str, root: str) -> str:
    """The sha256 of a file's bytes, remembered under ``root/digests`` by its path, size, inode and modification
    and change times: a later start reads no unchanged file whole (hashing costs about a second per GB, each
    start, otherwise). Any write to the file changes its change time, so a stale digest is never used."""
    st = os.stat(path)
    stamp = [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]
    memo = os.path.join(root, "digests", hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:32] + ".json")
    try:
        with open(memo) as fh:
            seen = json.load(fh)
        if seen["stamp"] == stamp:
            return seen["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        write_atomic(memo, json.dumps({"path": os.path.abspath(path), "stamp": stamp, "sha256": digest}), fsync=False)
    except OSError:
        pass  # a memo that cannot be written only costs the next start a re-read
    return digest


def content_id(src: Source, root: str) -> dict:
    """What the records are: every file's size and sha256 in order, or a hub dataset's id and fingerprint."""
    if src.builder == "hub":
        from launcher.data.sources import load_hub

        return {"hub": src.path, "name": src.name, "split": src.split, "fingerprint": load_hub(src)._fingerprint}
    return {"builder": src.builder, "files": [[os.path.getsize(f), file_digest(f, root)] for f in src.files]}


def tokenizer_id(tokenizer) -> str:
    """A hash of everything that decides the ids a tokenizer gives: its serialisation (vocabulary, merges,
    normalizer, pre-tokenizer, post-processor), its special tokens and its class."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha({"class": type(tokenizer).__name__, "body": hashlib.sha256(body.encode()).hexdigest(),
                 "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
                 "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "size": len(tokenizer)})[:16]


# ----------------------------------------------------------------------------------------------
# A tokenized source, memory-mapped


@dataclass
class Store:
    """One tokenized source, memory-mapped: row i = record i (dropped records are empty rows)."""

    path: str
    marker: dict
    tables: list  # pyarrow Tables over the memory-mapped files
    starts: np.ndarray  # first row of each Arrow chunk, and the total at the end
    offsets: list  # per chunk: row offsets into values (numpy views of the memory map)
    values: list  # per chunk: token ids (numpy views)
    masks: list  # per chunk: pyarrow BooleanArray of the loss mask (instruction), or None
    lengths: np.ndarray  # tokens per row
    drop: np.ndarray  # int8 drop code per row (0 = kept)
    first_trained: np.ndarray | None  # per row: first position >= 1 in the loss (instruction)

    @property
    def instruction(self) -> bool:
        return self.first_trained is not None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _where(self, row: int) -> tuple[int, int]:
        c = int(np.searchsorted(self.starts, row, side="right")) - 1
        return c, row - int(self.starts[c])

    def ids(self, row: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        c, r = self._where(row)
        o = self.offsets[c]
        a, b = int(o[r]), int(o[r + 1])
        return self.values[c][a + start: b if stop is None else min(b, a + stop)]

    def trained(self, row: int, stop: int | None = None) -> np.ndarray:
        """The loss mask of a row (all true for text)."""
        c, r = self._where(row)
        o = self.offsets[c]
        a, b = int(o[r]), int(o[r + 1])
        if stop is not None:
            b = min(b, a + stop)
        if self.masks[c] is None:
            return np.ones(b - a, dtype=bool)
        return self.masks[c].slice(a, b - a).to_numpy(zero_copy_only=False)


def open_store(path: str) -> Store:
    """Memory-map a cache's Arrow files. Read with pyarrow as ``datasets.Dataset.from_file`` does it (an IPC stream
    over a memory map), so that a start that finds its cache never imports ``datasets`` (about 2 s here)."""
    import pyarrow as pa

    with open(os.path.join(path, MARKER)) as fh:
        marker = json.load(fh)
    tables = []
    for f in marker["arrow"]:
        with pa.memory_map(os.path.join(path, f)) as mm:  # the table's buffers keep the map alive
            tables.append(pa.ipc.open_stream(mm).read_all())
    starts, offsets, values, masks, lengths, drop, first = [0], [], [], [], [], [], []
    for tab in tables:
        for chunk, dchunk in zip(tab.column("input_ids").chunks, tab.column("drop").chunks):
            o = chunk.offsets.to_numpy()
            offsets.append(o)
            values.append(chunk.values.to_numpy(zero_copy_only=True))
            lengths.append(np.diff(o))
            drop.append(dchunk.to_numpy())
            starts.append(starts[-1] + len(chunk))
        if "trained" in tab.column_names:
            masks += [c.values for c in tab.column("trained").chunks]
            first += [c.to_numpy() for c in tab.column("first_trained").chunks]
        else:
            masks += [None] * tab.column("input_ids").num_chunks
    cat = lambda xs, dt: np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt)  # noqa: E731
    return Store(path=path, marker=marker, tables=tables, starts=np.asarray(starts, dtype=np.int64), offsets=offsets,
                 values=values, masks=masks, lengths=cat(lengths, np.int64), drop=cat(drop, np.int8),
                 first_trained=cat(first, np.int32) if first else None)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


# ----------------------------------------------------------------------------------------------
# Building one


@dataclass(frozen=True)
class Settings:
    """Everything besides the records and the tokenizer that decides a tokenized source."""

    format: str
    text_field: str
    prompt_field: str
    response_field: str
    template: str | None
    train_on_prompt: bool
    encoding: str


def num_proc_for(asked, rows: int) -> int:
    """Processes for ``Dataset.map``: the cores for large data; one below 20,000 records, where starting
    workers costs more than it saves."""
    if asked != "auto":
        return int(asked)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if rows < 20_000 else max(1, min(cores, 8))


def _disk_need(src: Source) -> int:
    """About how many bytes a build writes at its peak: the records as Arrow, then the tokens (the Arrow copy is
    deleted once tokenized). Parquet holds its uncompressed size in its metadata."""
    raw = 0
    for f in src.files:
        try:
            if src.builder != "parquet":
                raise ValueError
            import pyarrow.parquet as pq

            md = pq.ParquetFile(f).metadata
            raw += sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
        except Exception:  # noqa: BLE001 (not parquet, or a damaged one: the read names it)
            raw += os.path.getsize(f)
    return int(raw * 1.6)  # + ids at 2 bytes per ~4 characters, offsets and masks


def _disk_full_error(src: Source, root: str, need: int | None) -> ConfigError:
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    want = f", about {need / 2**20:.0f} MiB needed" if need else ""
    return ConfigError([f"data.cache_dir: the disk holding {root} is full ({free / 2**20:.0f} MiB free{want}) while "
                        f"tokenizing {src.label}; rule: a cache is written whole before it is used (the partial one was "
                        "removed); fix: free space there, or data.cache_dir=<a directory on a disk with room>"], "data")


def tokenized(src: Source, settings: Settings, tokenizer, cache_dir: str, num_proc) -> Store:
    """The tokenized source: from the cache when a complete one exists for these records, settings and tokenizer,
    else built now (with a log line either way)."""
    root = cache_root(cache_dir)
    t0 = time.perf_counter()
    data_key = _sha({"v": CACHE_VERSION, "content": content_id(src, root), "settings": settings.__dict__})[:24]
    tok_key = tokenizer_id(tokenizer)
    parent = os.path.join(root, data_key)
    final = os.path.join(parent, tok_key)
    if is_complete(final):
        store = open_store(final)
        m = store.marker
        logger.info(f"data: {src.short}: reusing the tokenized cache {final} ({m['tokens']:,} tokens in {m['records']:,} "
                    f"records, made {m['created']}; hashed and opened in {time.perf_counter() - t0:.1f} s)")
        return store
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError([f"data.cache_dir: cannot create {parent} ({e.strerror}); rule: the tokenized-data cache "
                           "needs a writable directory; fix: data.cache_dir=<a writable directory>"], "data") from None
    with open(os.path.join(parent, f".{tok_key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same cache: wait for it, then reuse it
        if is_complete(final):
            logger.info(f"data: {src.short}: another process made the tokenized cache {final}; reusing it")
            return open_store(final)
        others = [d for d in os.listdir(parent) if not d.startswith(".") and d != tok_key
                  and is_complete(os.path.join(parent, d))]
        if others:
            with open(os.path.join(parent, others[0], MARKER)) as fh:
                prev = json.load(fh).get("tokenizer", "?")
            logger.info(f"data: {src.short}: the cache in {os.path.join(parent, others[0])} was made by another "
                        f"tokenizer ({prev}); tokenizing again for {getattr(tokenizer, 'name_or_path', '?')} (the old "
                        "cache is kept; delete it to free its space)")
        store = _build(src, settings, tokenizer, parent, final, tok_key, num_proc, root)
    logger.info(f"data: {src.short}: tokenized {store.marker['tokens']:,} tokens in {store.marker['records']:,} records "
                f"in {store.marker['seconds']:.1f} s with {store.marker['num_proc']} process(es); cached in {final} "
                f"({store.marker['bytes'] / 2**20:.1f} MiB)")
    return store


def _build(src: Source, st: Settings, tokenizer, parent: str, final: str, tok_key: str, num_proc, root: str) -> Store:
    import datasets

    t0 = time.perf_counter()
    tmp = os.path.join(parent, f".tmp-{tok_key}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    need = _disk_need(src) if src.builder != "hub" else None
    if need and shutil.disk_usage(parent).free < need:
        raise _disk_full_error(src, root, need)
    datasets.disable_progress_bars()
    try:
        os.makedirs(tmp)
        raw = read_records(src, st.encoding, os.path.join(tmp, "hf"), num_proc_for(num_proc, 10 ** 9))
        if len(raw) == 0:
            raise ConfigError([f"{src.label} holds no records; rule: at least one; fix: check the file"], "data")
        fmt = detect_format(st.format, list(raw.column_names), src.label, st.text_field, st.prompt_field,
                            st.response_field)
        nproc = num_proc_for(num_proc, len(raw))
        # a variable-length list column: datasets >= 4 calls it List, older ones (the floor, 2.20) Sequence
        seq = getattr(datasets, "List", None) or datasets.Sequence
        feats = {"input_ids": seq(datasets.Value(id_dtype(len(tokenizer)))), "drop": datasets.Value("int8"),
                 "max_id": datasets.Value("int64")}
        if fmt in INSTRUCTION:
            feats.update(trained=seq(datasets.Value("bool")), first_trained=datasets.Value("int32"))
        if nproc > 1:
            # Workers forked from a process whose tokenizer already ran batches would each print a warning and
            # fall back to one thread; the processes are the parallelism here.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            out = raw.map(tokenize_batch, batched=True, batch_size=1000, num_proc=nproc if nproc > 1 else None,
                          remove_columns=list(raw.column_names), features=datasets.Features(feats),
                          fn_kwargs={"fmt": fmt, "tokenizer": tokenizer, "text_field": st.text_field,
                                     "prompt_field": st.prompt_field, "response_field": st.response_field,
                                     "template": st.template, "train_on_prompt": st.train_on_prompt},
                          new_fingerprint=f"vramfit-{tok_key}", cache_file_name=os.path.join(tmp, "tokens.arrow"))
        except Exception as e:
            if is_disk_full(e, tmp):
                raise
            problem = diagnose(src, st.encoding)  # a record the reader accepted but that cannot be decoded
            if problem:
                raise ConfigError([problem], "data") from None
            raise
        files = [os.path.basename(c["filename"]) for c in out.cache_files]
        table = out.data.table
        drop = np.concatenate([c.to_numpy() for c in table.column("drop").chunks]) if len(out) else np.zeros(0, np.int8)
        max_id = int(max((int(np.max(c.to_numpy())) for c in table.column("max_id").chunks if len(c)), default=0))
        tokens = int(sum(len(c.values) for c in table.column("input_ids").chunks))
        counted = drop.copy()
        if src.builder == "text":
            counted[counted == 1] = 0  # blank paragraphs of a .txt file are layout, not records
        bad = np.flatnonzero(counted)[:LOCATED].tolist()
        where = locate(src, bad, st.encoding) if bad else {}
        del raw, out, table
        shutil.rmtree(os.path.join(tmp, "hf"), ignore_errors=True)
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in files)
        marker = {"version": CACHE_VERSION, "source": src.path, "files": list(src.files), "format": fmt,
                  "records": int(len(drop)), "tokens": tokens, "max_id": max_id, "dtype": id_dtype(len(tokenizer)),
                  "dropped": {str(k): int(v) for k, v in zip(*np.unique(counted[counted != 0], return_counts=True))},
                  "dropped_at": [[i, int(drop[i]), where.get(i, f"record {i + 1}")] for i in bad],
                  "blank_paragraphs": int(((drop == 1) & (counted == 0)).sum()),
                  "tokenizer": getattr(tokenizer, "name_or_path", "?"), "arrow": files, "bytes": size,
                  "num_proc": nproc, "seconds": round(time.perf_counter() - t0, 3),
                  "created": datetime.datetime.now().isoformat(timespec="seconds")}
        with open(os.path.join(tmp, MARKER), "w") as fh:
            json.dump(marker, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial cache is never left to be used
        if is_disk_full(e, root):
            raise _disk_full_error(src, root, need) from None
        raise
    return open_store(final)
