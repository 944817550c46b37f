"""A model directory's safetensors weights, read tensor by tensor straight into the tensor each one fills.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data
offsets) and the tensors' bytes; a sharded checkpoint adds ``model.safetensors.index.json`` (name -> file).
The ``safetensors`` library's ``safe_open`` maps the whole file into memory, and every page it reads stays in
this process's resident set until the file is closed: filling a 7B model that way holds up to the checkpoint's
whole size in RSS beside the weights it fills (the set-up peak doubles). Here each tensor's bytes are read with
``os.preadv`` into the destination when it is a CPU tensor of the checkpoint's dtype, or else into a staging
buffer (reused, the largest tensor's size; page-locked when it feeds a GPU) and copied from there with the
dtype conversion transformers makes (``Tensor.to``), so the weights are bitwise those ``from_pretrained`` gives.
Nothing of the file stays mapped; what the kernel caches of it is page cache, not this process's memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' dtype names (the format's specification) -> bytes per element, and the torch dtype where torch has one
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
HEADER_LIMIT = 100 * 1024 * 1024  # the format's own limit on a header's size (the library refuses a larger one)
# A full model's final/ is written in safetensors shards of at most this size (save_pretrained's max_shard_size):
# safetensors copies a shard's GPU tensors to the CPU before it writes them, so a shard is what writing adds to the
# host's memory (the plan's final phase counts it).
FINAL_SHARD_BYTES = 2 * 1024 ** 3


class CheckpointError(ValueError):
    """A weights file that is not whole safetensors: ``problem`` says what is wrong, after the file's path."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path} {problem}")
        self.path, self.problem = path, problem


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: its file, dtype (None where torch has none), shape and byte range in that file."""

    file: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


def read_header(path: str) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header alone (no tensor is read). Raises
    :class:`CheckpointError` for a file that is not safetensors, or is cut short (a tensor runs past its end)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, f"holds {size} bytes, fewer than a safetensors header's 8 (cut short, or not "
                                        "safetensors)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > HEADER_LIMIT:
            raise CheckpointError(path, f"says its header is {n} bytes long, and the file holds {size} (cut short, or "
                                        "not safetensors)")
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:  # JSON errors and UnicodeDecodeError
            raise CheckpointError(path, f"has a header that is not JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path, "has a header that is not a JSON object")
    base, data = 8 + n, size - 8 - n
    out = {}
    for name, spec in meta.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
            kind = str(spec["dtype"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(path, f"has a header entry for {name!r} without dtype, shape and "
                                        "data_offsets") from None
        if end > data or begin < 0:
            raise CheckpointError(path, f"is cut short: tensor {name!r} ends at byte {end} of the data, and the file "
                                        f"holds {data} bytes of data")
        if kind in ITEM_BYTES and end - begin != math.prod(shape) * ITEM_BYTES[kind]:
            raise CheckpointError(path, f"has tensor {name!r} of shape {list(shape)} {kind} in {end - begin} bytes "
                                        f"(it needs {math.prod(shape) * ITEM_BYTES[kind]})")
        out[name] = Entry(path, DTYPES.get(kind), shape, base + begin, end - begin)
    return out


def has_safetensors(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, n)) for n in (SINGLE, INDEX))


class Checkpoint:
    """Every tensor of a model directory's safetensors weights (one file, or shards and their index)."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(index, f"is unreadable ({type(e).__name__})") from None
        else:
            files = [SINGLE]
        self.entries: dict[str, Entry] = {}
        for name in files:
            self.entries.update(read_header(os.path.join(directory, name)))
        self.nbytes = sum(e.nbytes for e in self.entries.values())
        self._staging: torch.Tensor | None = None
        self._fds: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def read_into(self, key: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (any device and dtype, of the tensor's shape) with the tensor ``key``."""
        e = self.entries[key]
        if tuple(dest.shape) != e.shape:
            raise CheckpointError(e.file, f"has tensor {key!r} of shape {list(e.shape)}, the model's is "
                                          f"{list(dest.shape)}")
        if dest.device.type == "cpu" and dest.dtype == e.dtype and dest.is_contiguous():
            self._pread(e, dest)
            return
        staged = self._stage(e, pinned=dest.device.type == "cuda")
        self._pread(e, staged)
        with torch.no_grad():
            dest.copy_(staged)  # the dtype conversion of Tensor.to, as from_pretrained makes it
        if dest.device.type == "cuda":
            torch.cuda.current_stream(dest.device).synchronize()  # the staging buffer is reused by the next read

    def _stage(self, e: Entry, pinned: bool) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < e.nbytes or (pinned and not self._staging.is_pinned()):
            size = max(e.nbytes, self._staging.numel() if self._staging is not None else 0)
            self._staging = None
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
        return self._staging[:e.nbytes].view(e.dtype).view(e.shape)

    def _pread(self, e: Entry, dest: torch.Tensor) -> None:
        fd = self._fds.get(e.file)
        if fd is None:
            fd = self._fds[e.file] = os.open(e.file, os.O_RDONLY)
        buf = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < e.nbytes:
            n = os.preadv(fd, [buf[done:]], e.start + done)
            if n <= 0:
                raise CheckpointError(e.file, f"ended while {e.nbytes} bytes were read at {e.start} (cut short)")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._staging = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
