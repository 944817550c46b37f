"""Experiment trackers (``log.report_to``): the same numbers as metrics.jsonl, for a run watched from elsewhere.

TensorBoard is the default: event files in ``<run>/tensorboard/`` (``tensorboard --logdir runs``), written by
TensorBoard's own writer through ``torch.utils.tensorboard``, whose file writer queues events for a thread, so
a step pays for a queue put per value. W&B and MLflow are optional extras and start offline unless their
environment says otherwise (``WANDB_MODE``; ``MLFLOW_TRACKING_URI``, else ``<run>/mlruns``): nothing needs a
network. Only rank 0 writes. What is logged: each step's row (loss, lr, loss scale, grad norm, tokens/s,
memory and the per-phase peaks), eval metrics, and the plan as text.
"""

from __future__ import annotations

import importlib.util
import math
import os

TRACKERS = {  # name -> (module that must import, install line)
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'vramfit[wandb]'"),
    "mlflow": ("mlflow", "pip install 'vramfit[mlflow]'"),
}
# metrics.jsonl keys that are counters or settings, not curves
NOT_CURVES = {"step", "tokens", "tokens_in_loss", "time_s", "skipped", "micro_batch"}


def problems(report_to: list) -> list[str]:
    """Config problems of ``log.report_to`` (value, rule, fix): unknown names and trackers not installed."""
    out = []
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            out.append(f"log.report_to: got {name!r}; rule: tensorboard, wandb, mlflow or none; fix: "
                       "log.report_to=[tensorboard]")
        elif importlib.util.find_spec(TRACKERS[name][0]) is None:
            out.append(f"log.report_to: got {name!r}, which is not installed here; rule: a tracker must import; fix: "
                       f"{TRACKERS[name][1]}, or log.report_to=[tensorboard] (or none)")
    return out


def _curves(row: dict) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if k in NOT_CURVES or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        group = "memory" if k.endswith("_bytes") else "eval" if k.startswith("eval_") else "train"
        out[f"{group}/{k.removeprefix('eval_')}"] = float(v)
    return out


class Trackers:
    """The trackers of one run (none on ranks other than 0). ``log(row, step)``, ``text(tag, text)``, ``close()``."""

    def __init__(self, names: list, run_dir: str, run_name: str, config: dict, is_main: bool = True):
        self.names = [n for n in names if n != "none"] if is_main else []
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), flush_secs=30)
        if "wandb" in self.names:
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "vramfit"), name=run_name,
                                     dir=run_dir, config=config, mode=os.environ.get("WANDB_MODE", "offline"),
                                     resume="allow", id=run_name)
        if "mlflow" in self.names:
            import mlflow

            if not os.environ.get("MLFLOW_TRACKING_URI"):
                mlflow.set_tracking_uri("file:" + os.path.join(os.path.abspath(run_dir), "mlruns"))
            self._mlflow = mlflow
            mlflow.start_run(run_name=run_name)
            flat = {k: v for k, v in _flatten(config).items() if len(str(v)) < 500}
            mlflow.log_params(flat)

    def log(self, row: dict, step: int) -> None:
        if not self.names:
            return
        curves = _curves(row)
        if self._tb is not None:
            for k, v in curves.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(curves, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k.replace("/", "."): v for k, v in curves.items()}, step=step)

    def text(self, tag: str, text: str) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, "    " + text.replace("\n", "\n    "), 0)  # indented: shown as code
        if self._wandb is not None:
            self._wandb.summary[tag] = text
        if self._mlflow is not None:
            self._mlflow.log_text(text, f"{tag}.txt")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()
        self._tb = self._wandb = self._mlflow = None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
