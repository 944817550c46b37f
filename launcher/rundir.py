"""The run directory (contract in DESIGN.md): config.yaml, plan.json, ds_config.json, metrics.jsonl,
memory.csv, summary.json, checkpoints/, final/. Only rank 0 writes; every write of a whole file goes
to a temporary name first and is renamed, so a kill never leaves half a file behind.
"""

from __future__ import annotations

import json
import math
import os
import time

SUMMARY_KEYS = ("status", "engine", "profile", "precision", "device", "steps", "first_loss", "final_loss",
                "tokens_per_s", "peak_gpu_bytes", "peak_cpu_rss_bytes", "predicted_gpu_bytes",
                "predicted_cpu_bytes", "skipped_steps", "fallbacks", "resumed_from")
METRIC_KEYS = ("step", "loss", "lr", "loss_scale", "skipped", "grad_norm", "tokens", "tokens_per_s",
               "gpu_allocated_bytes", "gpu_reserved_bytes", "cpu_rss_bytes", "time_s")


def _clean(obj):
    """JSON cannot hold inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(_clean(obj), indent=2) + "\n")


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


class RunDir:
    def __init__(self, path: str, is_main: bool = True):
        self.path = path
        self.is_main = is_main
        self._metrics = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self.file("checkpoints")

    def create(self) -> None:
        if self.is_main:
            os.makedirs(self.checkpoints, exist_ok=True)

    def write_text(self, name: str, text: str) -> None:
        if self.is_main:
            write_atomic(self.file(name), text)

    def write_json(self, name: str, obj) -> None:
        if self.is_main:
            write_json(self.file(name), obj)

    def append_metrics(self, row: dict) -> None:
        if not self.is_main:
            return
        if self._metrics is None:
            self._metrics = open(self.file("metrics.jsonl"), "a", buffering=1)
        self._metrics.write(json.dumps(_clean(row)) + "\n")

    def truncate_metrics(self, last_step: int) -> None:
        """On resume: drop lines past the checkpoint's step (they will be recomputed)."""
        path = self.file("metrics.jsonl")
        if not self.is_main or not os.path.exists(path):
            return
        keep = [ln for ln in open(path) if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
        write_atomic(path, "".join(keep))

    def metrics(self) -> list[dict]:
        path = self.file("metrics.jsonl")
        return [json.loads(ln) for ln in open(path) if ln.strip()] if os.path.exists(path) else []

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def default_run_name(model_name: str) -> str:
    base = os.path.basename(os.path.normpath(model_name)) or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"
