"""What one training run carries: the loop's :class:`State` (what a checkpoint keeps) and the :class:`Run` record
that :func:`launcher.training.prepare.prepare` fills, :func:`launcher.training.loop.fit` trains and
:func:`launcher.training.finish.finish` closes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from launcher.config.schema import Config
from launcher.machine import dist, threads
from launcher.machine.hardware import Hardware
from launcher.plan.resolve import RunSpec
from launcher.training.faults import Hooks
from launcher.training.monitor import MemoryMonitor
from launcher.training.rundir import RunDir
from launcher.training.startup import Startup
from launcher.training.tracking import Trackers


@dataclass
class State:
    """What the loop carries from step to step and through a checkpoint (every field but ``resumed_from`` goes
    into the checkpoint's client state, as it is named here)."""

    step: int = 0
    first_loss: float | None = None
    skipped: int = 0
    fallbacks: list = field(default_factory=list)
    resumed_from: str | None = None
    tokens_seen: int = 0  # tokens processed, padding left out
    tokens_in_loss: int = 0  # positions whose next token is in the loss
    best_eval_loss: float | None = None  # the lowest eval loss so far
    best_checkpoint: str | None = None  # its checkpoint (checkpoint.keep_best), kept out of the rotation
    evals_since_best: int = 0  # evals in a row without a lower loss (train.early_stopping_patience)

    def client(self) -> dict:
        """The fields a checkpoint carries."""
        return {k: v for k, v in asdict(self).items() if k != "resumed_from"}

    @classmethod
    def from_client(cls, client: dict, resumed_from: str) -> State:
        """The state a checkpoint's client state restores (a field an older checkpoint lacks keeps its default)."""
        known = {f.name for f in fields(cls)} - {"resumed_from"}
        return cls(**{k: v for k, v in client.items() if k in known}, resumed_from=resumed_from)


@dataclass
class Run:
    """One training run, from :func:`prepare` to :func:`finish`: what was decided, what was built, how it went."""

    cfg: Config  # settled: data formats resolved, epochs turned into steps
    asked: Config  # the settings as the user gave them (what a resume compares)
    hooks: Hooks
    ranks: dist.Dist
    hw: Hardware
    threads: threads.Threads
    hf_config: object
    spec: RunSpec  # moves down the OOM ladder
    tokenizer: object
    train_data: object
    eval_data: object
    sample_prompt: object
    rd: RunDir | None = None
    run_name: str = ""
    resume_from: str | None = None
    damaged: list = field(default_factory=list)  # checkpoints newer than resume_from that failed their checks
    mon: MemoryMonitor | None = None
    engine: object = None
    model: object = None
    init_peak_gpu: int | None = None
    trackers: Trackers | None = None
    st: State = field(default_factory=State)
    status: str = "completed"  # | failed | interrupted | stopped_early
    diagnosis: str | None = None
    last_ckpt: str | None = None
    loss: float = float("nan")  # the last step's loss
    last_scale: float | None = None  # fp16 loss scale after the last step
    peak_rss: int = 0
    elapsed: float = 0.0
    calibration_doubtful: str | None = None  # the speeds that priced the plan were measured on a busy machine
    startup: Startup | None = None  # where the time to the first step went
    oom: dict | None = None  # an OOM on one of several ranks since the checkpoint: the rung all go on with
    objective: object = None  # a preference task's loss (launcher.model.preference.Objective), None for causal LM
    pref_metrics: dict | None = None  # the last step's preference rewards, margin and accuracy

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "stopped_early")
