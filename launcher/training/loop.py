"""The training loop. One loop for every engine, in three steps around one :class:`Run` record.

:func:`prepare` decides everything before anything loads (probe, resolve into a frozen RunSpec, plan), loads
the data, claims the run directory and its resume point, builds the engine and restores a checkpoint;
:func:`fit` runs the steps (micro-batches forward + backward, the engine's step, log, eval, checkpoint, the
OOM ladder); :func:`finish` writes what the run leaves behind (final weights, summary, plot, a sample).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace

import psutil
import torch

from launcher import engines, log
from launcher.config.profiles import PROFILES
from launcher.config.schema import Config, ConfigError, to_dict, to_yaml, with_epochs
from launcher.data import load_splits
from launcher.engines.base import StepResult, host_values
from launcher.log import logger
from launcher.machine import diskspace, dist, heap, speeds, threads
from launcher.machine.files import DiskFull, disk_full_message, is_disk_full, read_json
from launcher.machine.hardware import Hardware, enforce_gpu_budget, probe
from launcher.model import hfconfig, kernels, lora, preference
from launcher.model.build import build_model, count_params, load_tokenizer, model_config
from launcher.plan import decide, report
from launcher.plan.ladder import Move, Rung, next_move
from launcher.plan.resolve import RunSpec
from launcher.training import checkpoint as ckpt
from launcher.training import generate, plots, progress, rankladder
from launcher.training.faults import Hooks, StopRequested, diagnose
from launcher.training.monitor import MemoryMonitor
from launcher.training.rundir import LOCK, LockHeld, RunDir, RunLock, default_run_name, failed_start, set_aside_failed_start
from launcher.training.schedule import lr_at
from launcher.training.startup import Startup
from launcher.training.tracking import Trackers
from launcher.units import GiB


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


def train(cfg: Config, hooks: Hooks | None = None, hw: Hardware | None = None) -> dict:
    """Run one training job end to end. Returns the summary (also written to summary.json)."""
    try:
        with contextlib.ExitStack() as cleanup:  # the run directory's lock, released however the run ends
            run = prepare(cfg, hooks or _hooks(), hw, cleanup)
            fit(run)
            return finish(run)
    finally:
        engines.restore_globals()  # what an engine changed for the whole process, also when it failed to build


def _hooks() -> Hooks:
    """No test hooks but the launcher's test-only OOM (launcher.training.rankladder.FAULT_ENV) where it is set."""
    hooks = Hooks()
    hooks.before_step = hooks.before_step or rankladder.fault_from_env()
    return hooks


# ---------------------------------------------------------------------------------------------------- prepare
def prepare(cfg: Config, hooks: Hooks, hw: Hardware | None, cleanup: contextlib.ExitStack) -> Run:
    """Everything before the first step: decide, load the data, claim the run directory, build the engine,
    restore the checkpoint being continued. Input problems surface before the run directory exists, and a
    refused resume changes nothing in it."""
    startup = Startup()
    ranks = dist.current()
    log.setup(cfg.log.level, ranks.rank)
    # before the process group and the engine start their threads (launcher/machine/heap.py)
    heap_done = heap.fix_mmap_threshold(heap.threshold_mib(cfg.memory.mmap_threshold_mib, ranks.world))
    logger.debug(f"heap: {heap_done}")
    dist.init(torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"))
    th = _threads(cfg, ranks)
    asked = cfg  # what a checkpoint compares on resume: the settings as the user gave them
    hf_config, d = _decide(cfg, hw or probe(), ranks)
    cfg, spec, machine, hw = d.cfg, d.spec, d.machine, d.hw  # hw: memory.nvme_path measured
    startup.lap("plan")
    share = _host_share(spec.plan)
    if ranks.world == 1 and cfg.memory.mmap_threshold_mib == "auto" and heap.threshold_mib("auto", 1, share) > 0:
        # the plan leaves the heap too little room: from here on (before the model is made) big blocks go back
        done = heap.fix_mmap_threshold(heap.threshold_mib("auto", 1, share))
        logger.info(f"heap: {done} (the planned host peak is {share:.0%} of the host budget)")
    tokenizer = load_tokenizer(cfg)
    train_data, eval_data = load_splits(cfg, hf_config.vocab_size, tokenizer, hf_config)
    startup.lap("data")
    if cfg.train.epochs:
        cfg = with_epochs(cfg, len(train_data))
        logger.info(f"train.epochs={cfg.train.epochs:g} over {len(train_data)} samples: {cfg.train.max_steps} steps "
                    f"of {cfg.train.global_batch_size}, warmup {cfg.train.warmup_steps}")
    run = Run(cfg=cfg, asked=asked, hooks=hooks, ranks=ranks, hw=hw, threads=th, hf_config=hf_config, spec=spec,
              tokenizer=tokenizer, train_data=train_data, eval_data=eval_data,
              sample_prompt=generate.prompt_ids(cfg, tokenizer, eval_data if eval_data is not None else train_data),
              calibration_doubtful=machine.doubtful if machine is not None else None, startup=startup)
    _check_disk(run)
    run.rd, run.resume_from, run.run_name, run.damaged = prepare_run_dir(cfg, ranks, cleanup)
    if run.resume_from:
        run.spec = _resume_spec(run)
        run.rd.hold()  # nothing is written into the run being continued until its checkpoint has loaded
    run.oom = rankladder.pending(run.rd.path, ckpt.read_marker(run.resume_from)["step"] if run.resume_from else 0,
                                 ranks)
    if run.oom is not None:  # a rank ran out of memory after that checkpoint: every rank goes on one rung down
        run.spec = run.spec.at(Rung(**run.oom["to"]))
        logger.info(f"OOM ladder: rank {run.oom['rank']} ran out of memory at step {run.oom['step']}; every rank "
                    f"goes on from {run.resume_from or 'the start'}: {run.oom['reason']}")
    run.rd.write_text("config.yaml", to_yaml(replace(cfg, run_name=run.run_name, model=replace(
        cfg.model, gradient_checkpointing=run.spec.checkpointing, checkpoint_every=run.spec.checkpoint_every))))
    if run.spec.plan is not None:
        run.rd.write_json("plan.json", run.spec.plan.to_json())
    if run.device.type == "cuda":
        torch.cuda.set_device(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        capped = enforce_gpu_budget(cfg.memory.gpu_budget, run.device)
        if capped:
            logger.info(capped)
    run.mon = MemoryMonitor.for_run(cfg, run.rd, run.device)  # stopped at the end of fit
    if not run.resume_from:
        run.mon.start()  # memory.csv from here (a resume appends to it once its checkpoint has loaded)
    startup.lap("run directory")
    run.objective = preference.objective_for(cfg)
    run.engine, run.model = make_engine(cfg, run.spec, hw, hf_config, run.rd, startup=startup,
                                        objective=run.objective)
    if run.device.type == "cuda":  # engine set-up can briefly hold two copies of the weights; training is apart
        run.init_peak_gpu = torch.cuda.max_memory_allocated(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
    n_total, n_train = count_params(run.model)
    logger.info(f"model {cfg.model.name}: {n_total / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable); "
                f"data: {len(train_data)} samples of up to {cfg.data.seq_len} tokens, {train_data.description}")
    logger.info(f"engine {run.engine.name}, profile {run.spec.profile.name}, optimizer {run.engine.optimizer_name}, "
                f"micro-batch {run.spec.micro_batch} x accumulation {run.spec.accumulation} x {ranks.world} rank(s) = "
                f"{cfg.train.global_batch_size}")
    if run.resume_from:
        _restore(run)
        startup.lap("resume")
    if run.objective is not None and run.objective.reference == "precompute":
        _precompute_reference(run)
        startup.lap("reference log-probs")
    if run.oom is not None:  # the move is the run's, as one made in place is
        run.st.fallbacks.append({k: run.oom[k] for k in ("from", "to", "reason", "step", "rank")})
    # trackers only once a resume has loaded (a refused one changes nothing in the run directory); one that
    # fails is switched off; closed after the loop, and when the run ends with an exception
    run.trackers = Trackers(cfg.log.report_to, run.rd.path, run.run_name, to_dict(cfg), ranks.is_main,
                            warn=logger.warning, folder=cfg.log.tracker_dir)
    cleanup.callback(run.trackers.close)
    if run.spec.plan is not None:
        run.trackers.text("plan", report.format_table(run.spec.plan))
    return run


def _threads(cfg: Config, ranks: dist.Dist) -> threads.Threads:
    """Intra-op threads: the cores other processes leave free (launcher.machine.threads); several ranks on one
    machine share its cores and start together (each would count the others as neighbours), so they split them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    th = threads.decide(cfg.train.threads, max(1, threads.cores() // max(1, local)), busy=0.0 if local > 1 else None)
    threads.apply(th)
    logger.info(f"threads: {th.intra_op} intra-op ({th.reason}); OMP_WAIT_POLICY {th.wait_policy}; data workers "
                f"{th.data_workers} (batches are cut from tokens in memory in the loop's thread)")
    return th


def _host_share(plan) -> float | None:
    """The chosen setting's planned host peak over the plan's host budget (None without a plan or a choice)."""
    if plan is None or plan.chosen_plan is None or not plan.budget.get("cpu_bytes"):
        return None
    return plan.chosen_plan.cpu_bytes / plan.budget["cpu_bytes"]


def _decide(cfg: Config, hw: Hardware, ranks: dist.Dist) -> tuple[object, decide.Decision]:
    """(model config, the run decided: :func:`launcher.plan.decide.decide`), before anything loads. The plan uses the
    speeds when `vramfit doctor --calibrate` has run, to pick the fastest predicted setting that fits (never measured
    here: a training start stays fast)."""
    hf_config = model_config(cfg)
    hfconfig.check_weights(cfg.model.name, hf_config, trust_remote_code=cfg.model.trust_remote_code)
    lora.check(cfg, hf_config)  # bitsandbytes present when needed; LoRA target names exist (on a meta model)
    machine, why = speeds.cached()
    if why:
        logger.warning(why)
    d = decide.decide(cfg, hw=hw, machine=machine, world=ranks.world, local_rank=ranks.local_rank)
    for line in d.notes:
        logger.warning(line)
    for r in d.spec.reasons:
        logger.info(r)
    kernels.check(d.cfg, d.spec.device.type)  # model.liger where it cannot run
    hfconfig.check_seq_len(hf_config, d.cfg.data.seq_len)  # resolve's planner checked it too: one rule for both
    return hf_config, d


def _check_disk(run: Run) -> None:
    """Room for the checkpoints and final/ on the output disk, before anything is written."""
    cfg = run.cfg
    if not cfg.checkpoint.save:
        return
    disk = diskspace.room(cfg.output_dir, run.spec.predicted("checkpoint_bytes") or 0,
                          run.spec.predicted("final_bytes") or 0, cfg.checkpoint.keep_last + int(cfg.checkpoint.keep_best),
                          run_dir=os.path.join(cfg.output_dir, cfg.run_name) if cfg.run_name else None)
    problem = diskspace.refusal(disk, cfg.lora.r)
    if problem:
        raise ConfigError([problem], "disk plan")
    logger.info(diskspace.describe(disk))


def _resume_spec(run: Run) -> RunSpec:
    """The RunSpec a resume goes on with: the OOM ladder's rung where the checkpoint was written. Refused when the
    settings that must match have changed."""
    resume_from, spec = run.resume_from, run.spec
    marker = ckpt.read_marker(resume_from)
    diff = ckpt.diff_settings(marker["settings"], ckpt.fixed_settings(run.asked))
    if diff:
        raise ConfigError([f"checkpoint {resume_from}: settings changed since it was written; rule: these must "
                           f"match to resume; fix: restore them or choose another run_name. Changes: {'; '.join(diff)}"])
    rung = Rung(**marker["rung"]) if marker.get("rung") else spec.rung
    custom = rung.profile not in PROFILES  # written by a deepspeed_config run (its custom row)
    if (custom or spec.user_ds is not None) and rung.profile != spec.profile.name:
        raise ConfigError([f"checkpoint {resume_from}: written by profile {rung.profile}, this run is "
                           f"{spec.profile.name}; rule: a run with its own deepspeed_config resumes with the same "
                           "JSON layout, and a catalogue run without one; fix: the deepspeed_config the run "
                           "started with (or none), or another run_name"])
    if "files" not in marker:
        logger.info(f"checkpoint {resume_from} was written before checkpoints carried checksums: not verified")
    saved_world = int(marker.get("world", run.ranks.world))  # older checkpoints resumed on as many ranks
    if saved_world != run.ranks.world:
        moved, note = spec.moved(rung, saved_world, resume_from, run.cfg.train.global_batch_size)
        logger.info(note)
        return moved
    return spec.at(rung)  # continue where the OOM ladder had got to


REFERENCE_FILE = "reference_logps.pt"


def _precompute_reference(run: Run) -> None:
    """``preference.reference=precompute``: the reference's log-probs of every pair, computed once from the starting
    weights (before the first step) and kept in the run directory, where a resume reads them back (its weights
    have moved on); the batches then carry them and no reference pass runs while training."""
    path = run.rd.file(REFERENCE_FILE)
    if run.resume_from:
        if not os.path.isfile(path):
            raise ConfigError([f"checkpoint.resume: {run.rd.path} has no {REFERENCE_FILE}, the reference log-probs "
                               "computed at its start; rule: a run with preference.reference=precompute resumes with "
                               "them (its weights are no longer the reference); fix: another run_name to start again"])
        saved = torch.load(path, map_location="cpu", weights_only=True)
        logger.info(f"reference log-probs from {path}")
    else:
        t0 = time.perf_counter()
        saved = {}
        for split, data in (("train", run.train_data), ("eval", run.eval_data)):
            if data is None:
                continue
            ids = data.pair_ids()
            ref = torch.full((len(data.samples), 2), float("nan"), dtype=torch.float32)
            m = run.spec.micro_batch
            for start in range(0, len(data), m):
                idx = list(range(start, min(start + m, len(data))))
                got = run.engine.reference_logps(data.batch(idx, with_ref=False))
                ref[ids[idx], 0], ref[ids[idx], 1] = got[:len(idx)], got[len(idx):]
            saved[split] = ref
        if run.ranks.is_main:
            torch.save(saved, path)
        logger.info(f"reference log-probs of {len(run.train_data)} training pairs"
                    + (f" and {len(run.eval_data)} eval pairs" if run.eval_data is not None else "")
                    + f" computed in {time.perf_counter() - t0:.1f} s (once, from the starting weights; kept in "
                    f"{REFERENCE_FILE}); no reference pass while training")
    run.train_data = run.train_data.with_reference(saved["train"])
    if run.eval_data is not None:
        run.eval_data = run.eval_data.with_reference(saved["eval"])


def _restore(run: Run) -> None:
    """Load the checkpoint being continued into the engine and the loop's state; only then is the run directory
    written to (metrics cut back to its step, damaged newer checkpoints set aside)."""
    try:
        client = run.engine.load(run.resume_from)
    except Exception as e:  # noqa: BLE001 -- each engine's loader fails its own way (torch, DeepSpeed, DCP)
        run.engine.close()
        older = ckpt.older_loadable(run.resume_from)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError([f"checkpoint.resume: {run.resume_from} matches its recorded sizes and checksums but does "
                           f"not load ({type(e).__name__}: {first}); rule: a checkpoint that this engine wrote for "
                           "this model; fix: " + (f"checkpoint.resume={older}" if older else "another run_name (no "
                           "older checkpoint loads)") + "; nothing in the run directory was changed"]) from None
    run.st = State.from_client(client, run.resume_from)
    rng = client["rng"]
    if not isinstance(rng, list):
        ckpt.set_rng_state(rng)
    elif run.ranks.rank < len(rng):  # a rank the checkpoint did not have keeps the seed's stream (more ranks now)
        ckpt.set_rng_state(rng[run.ranks.rank])
    if run.ranks.is_main:
        for path, _why in run.damaged:  # out of the resume and rotation order, kept for a look
            logger.info(f"damaged checkpoint {path} kept as {ckpt.set_aside(path)}")
    run.rd.truncate_metrics(run.st.step)
    run.rd.commit()
    run.mon.start()
    logger.info(f"resumed from {run.resume_from} at step {run.st.step}")


# ---------------------------------------------------------------------------------------------------- fit
def fit(run: Run) -> None:
    """Train until ``train.max_steps``, an early stop, a signal or a failure; the last checkpoint is written.
    ``run.status`` and ``run.diagnosis`` say how it ended."""
    cfg, st, ranks = run.cfg, run.st, run.ranks
    stop = StopRequested().install()
    t_start = time.perf_counter()
    run.peak_rss = psutil.Process().memory_info().rss
    if run.startup is not None:
        run.startup.lap("trackers")
        logger.info(run.startup.describe())
    at_min_scale = 0  # fp16 steps in a row that overflowed at the minimum loss scale
    bar = progress.Progress(cfg, st.step, ranks.is_main)
    try:
        while st.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(st.step, cfg.train)
            done = _step(run, lr)
            if isinstance(done, Move):
                _climb(run, done)
                continue
            if done is None:  # run.status says why
                break
            batch, result = done
            row = _record(run, batch, result, lr, time.perf_counter() - t0, time.perf_counter() - t_start)
            bar.update(row)  # a bar on a terminal, else a log line every log.every_steps
            # fp16 that keeps overflowing at the minimum scale will never train: stop with a diagnosis
            at_min = result.skipped and result.loss_scale is not None and result.loss_scale <= cfg.loss_scale.min_scale
            at_min_scale = at_min_scale + 1 if at_min else 0
            if at_min_scale >= cfg.loss_scale.patience:
                run.status, run.diagnosis = "failed", diagnose(
                    run.engine, run.train_data, run.spec.rung, st.step, cfg, lr,
                    f"{at_min_scale} steps in a row overflowed at the minimum loss scale {cfg.loss_scale.min_scale:g}")
                break
            if _between_steps(run, stop):
                break
        run.last_ckpt = save_checkpoint(run) if cfg.checkpoint.save else None
    except OSError as e:  # a full disk ends the run as failed, with a summary and the last good checkpoint
        if not isinstance(e, DiskFull) and not is_disk_full(e, run.rd.path):
            raise
        run.status, run.last_ckpt = "failed", ckpt.latest(run.rd.checkpoints)
        run.diagnosis = disk_advice(e, run.rd, run.last_ckpt)
    finally:
        stop.restore()
        run.rd.close()
        bar.close()
        run.mon.stop()
        run.elapsed = time.perf_counter() - t_start


def _step(run: Run, lr: float):
    """One optimizer step: this rank's micro-batches forward and backward, then the engine's update.

    Returns (batch, StepResult); a :class:`Move` when an OOM asks the ladder for a lower rung (returned, not
    taken here: until the except block ends, the exception's traceback keeps the failed step's frames, and with
    them its activations and the engine, from being freed); None when the run must stop (``run.status``)."""
    st, spec, engine, hooks, ranks = run.st, run.spec, run.engine, run.hooks, run.ranks
    try:
        if hooks.before_step:
            hooks.before_step(st.step, engine)
        run.mon.mark("forward", engine)  # model hooks split forward from backward
        if run.objective is not None:
            run.objective.stats.take()  # what a step cut short by an OOM left behind
        batch = run.train_data.step(st.step, run.cfg.train.global_batch_size, spec.micro_batch, ranks.rank,
                                    ranks.world, run.cfg.seed)  # this rank's micro-batches: stacked, padded or packed
        losses = [engine.forward_backward(b, spec.accumulation) for b in batch.batches]
        if hooks.after_backward:
            hooks.after_backward(st.step, engine)
        run.mon.mark("step")
        # The engine skips an update whose gradients hold inf/nan by itself (a nan loss makes them so), so the
        # loss is read after the update is queued, with the step's other numbers, in one host transfer: a GPU
        # waits for the host once per step, not at the loss and again at the norm.
        result: StepResult = engine.step(lr)
        sums = run.objective.stats.take() if run.objective is not None else {}
        loss, skipped, scale, norm, *rest = host_values([torch.stack(losses).mean(), result.skipped,
                                                         result.loss_scale, result.grad_norm, *sums.values()])
        if run.objective is not None:
            run.pref_metrics = preference.step_metrics({k: ranks.mean(v) for k, v in zip(sums, rest)})
        run.loss, run.last_scale = ranks.mean(loss), scale
        if not math.isfinite(run.loss) and spec.precision != "fp16":  # its update was not applied
            run.status, run.diagnosis = "failed", diagnose(engine, run.train_data, spec.rung, st.step, run.cfg, lr,
                                                           f"loss became {run.loss} at step {st.step + 1}")
            return None
        return batch, StepResult(skipped=bool(skipped), loss_scale=scale, grad_norm=norm)
    except torch.OutOfMemoryError:  # anything else propagates untouched
        # One process only: with several ranks the others wait in a collective of this step and cannot take
        # part in a move (portable_state and a new engine are collectives too).
        fallback = run.cfg.train.oom_fallback
        move = next_move(spec.rung, list(spec.usable)) if fallback else None
        if move is None:
            raise
        if ranks.world > 1:  # the other ranks wait inside this step's collectives: all start again, one rung down
            rankladder.record(run.rd.path, st.step + 1, ranks.rank, ranks.world, spec.rung, move)
            logger.info(f"OOM at step {st.step + 1} on rank {ranks.rank}: {move.reason}; every rank goes on from the "
                        f"last checkpoint at that rung when the run starts again (torchrun --max-restarts does it; "
                        f"else the same command with run_name={run.run_name})", extra={"all_ranks": True})
            logging.shutdown()
            os._exit(rankladder.EXIT_OOM_RESTART)  # a normal exit would wait on the other ranks' collectives
    return move


def _climb(run: Run, move: Move) -> None:
    """Go on one rung down the OOM ladder: in place where the engine can (a smaller micro-batch, checkpointing),
    else a new engine rebuilt from the last state (weights, moments and the fp16 loss scale)."""
    logger.info(f"OOM at step {run.st.step + 1}: {move.reason}")
    run.st.fallbacks.append({"from": asdict(run.spec.rung), "to": asdict(move.to), "reason": move.reason,
                             "step": run.st.step + 1})
    spec = run.spec.at(move.to)
    if move.kind == "profile" or not run.engine.resets_in_place:
        state, scale_state = run.engine.portable_state(), run.engine.loss_scale_state()
        run.engine.close()  # DeepSpeed keeps references (hooks) that would outlive the object
        run.mon.unwatch()
        run.engine = run.model = None
        free_memory(run.device)
        run.engine, run.model = make_engine(run.cfg, spec, run.hw, run.hf_config, run.rd, state,
                                            objective=run.objective)
        run.engine.load_portable_state(state, run.st.step - run.st.skipped, scale_state)
        del state
    else:
        run.engine.apply_move(move, spec.offload_activations)
        free_memory(run.device)
    run.spec = spec


def _record(run: Run, batch, result: StepResult, lr: float, dt: float, since_start: float) -> dict:
    """Count a finished step into the state and write its row (metrics.jsonl, trackers); returns the row."""
    st = run.st
    st.step += 1
    st.tokens_seen += batch.tokens
    st.tokens_in_loss += batch.tokens_in_loss
    st.skipped += int(result.skipped)
    if st.first_loss is None:
        st.first_loss = run.loss
    mem = memory_now(run.device)
    run.peak_rss = max(run.peak_rss, mem["cpu_rss_bytes"])
    row = {"step": st.step, "loss": run.loss, "lr": lr, "loss_scale": result.loss_scale, "skipped": result.skipped,
           "grad_norm": result.grad_norm, "tokens": st.tokens_seen, "tokens_per_s": batch.tokens / dt,
           "tokens_in_loss": st.tokens_in_loss, "tokens_in_loss_per_s": batch.tokens_in_loss / dt, **mem,
           "time_s": since_start, "micro_batch": run.spec.micro_batch, **(run.pref_metrics or {}),
           **run.mon.end_step(st.step, mem)}
    run.rd.append_metrics(row)
    run.trackers.log(row, st.step)
    return row


def _between_steps(run: Run, stop: StopRequested) -> bool:
    """Eval, the test hook, signals and the periodic checkpoint after a step. True when the run stops here."""
    cfg, st = run.cfg, run.st
    saved_here = False
    if run.eval_data is not None and cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
        if run_eval(run):
            run.status = "stopped_early"
            logger.info(f"early stop at step {st.step}: {st.evals_since_best} evals without a lower eval loss than "
                        f"{st.best_eval_loss:.4f}")
            return True
        saved_here = st.best_checkpoint == ckpt.step_dir(run.rd.checkpoints, st.step)
    if run.hooks.after_step:
        run.hooks.after_step(st.step)
    if run.ranks.any(bool(stop)):  # ranks agree, so all of them save the same step
        run.status = "interrupted"
        return True
    if (cfg.checkpoint.save and cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0
            and st.step < cfg.train.max_steps and not saved_here):
        save_periodic(run)
    return False


def save_checkpoint(run: Run) -> str:
    """A checkpoint of this step (engine state, the loop's :class:`State`, every rank's RNG, the ladder's rung)."""
    st, cfg = run.st, run.cfg
    client = {**st.client(), "samples_seen": st.step * cfg.train.global_batch_size,
              "rng": run.ranks.gather(ckpt.rng_state())}
    with run.mon.host_phase("checkpoint"):
        path = ckpt.save(run.engine, run.rd.checkpoints, st.step, client, ckpt.fixed_settings(run.asked),
                         is_main=run.ranks.is_main, barrier=run.ranks.barrier, keep_last=cfg.checkpoint.keep_last,
                         extra={"rung": asdict(run.spec.rung), "world": run.ranks.world},
                         during_save=run.hooks.during_save, predicted_bytes=run.spec.predicted("checkpoint_bytes"),
                         keep=(st.best_checkpoint,) if cfg.checkpoint.keep_best and st.best_checkpoint else ())
    logger.info(f"checkpoint {path}")
    return path


def save_periodic(run: Run) -> bool:
    """A checkpoint on the way that does not fit on the disk is skipped with a warning (its partial files are
    already gone) and the run goes on; the last one must fit (DiskFull ends the run as failed, with the last
    good checkpoint). Returns whether it was written."""
    try:
        save_checkpoint(run)
        return True
    except DiskFull as e:
        logger.warning(f"checkpoint at step {run.st.step} skipped: {e}; the run goes on, the last good checkpoint is "
                       f"{ckpt.latest(run.rd.checkpoints) or 'none yet'}; fix: free space there or lower "
                       "checkpoint.keep_last")
        return False


def run_eval(run: Run) -> bool:
    """Eval loss and perplexity now; the best is kept (checkpoint.keep_best). True when the run should stop
    (train.early_stopping_patience evals in a row without a lower loss)."""
    st, cfg = run.st, run.cfg
    ev = evaluate(run.engine, run.eval_data, run.spec.micro_batch, run.ranks, cfg.eval.max_batches)
    improved = st.best_eval_loss is None or ev < st.best_eval_loss
    if improved:
        st.best_eval_loss, st.evals_since_best = ev, 0
    else:
        st.evals_since_best += 1
    ppl = perplexity(ev, cfg.task)
    logger.info(f"eval loss {ev:.4f}" + (f", perplexity {ppl:.4g}" if ppl is not None else "") + f" at step {st.step}"
                + (" (best so far)" if improved else f" (best {st.best_eval_loss:.4f}; {st.evals_since_best} "
                                                     "without improvement)"))
    run.trackers.log({"eval_loss": ev, **({"eval_perplexity": ppl} if ppl is not None else {}),
                      "eval_best_loss": st.best_eval_loss}, st.step)
    if improved and cfg.checkpoint.keep_best and cfg.checkpoint.save:
        previous, st.best_checkpoint = st.best_checkpoint, ckpt.step_dir(run.rd.checkpoints, st.step)
        if not save_periodic(run):  # the checkpoint recorded itself as the best; it was not written
            st.best_checkpoint = previous
    patience = cfg.train.early_stopping_patience
    return bool(patience) and st.evals_since_best >= patience


# ---------------------------------------------------------------------------------------------------- finish
def finish(run: Run) -> dict:
    """What a run leaves behind, in the order that keeps the most if something fails: the final eval and
    final/ (from the best checkpoint after an early stop), summary.json, memory.png, then the sample after
    training, which is a courtesy: one that fails is a warning in the summary, never a failed run."""
    eval_loss = _final_weights(run)
    if run.diagnosis:
        (logger.error if run.status == "failed" else logger.info)(f"stopped: {run.diagnosis}")
    summary = summary_of(run, eval_loss)
    try:
        run.rd.write_json("summary.json", summary)
    except DiskFull as e:  # the run's state is in its last checkpoint and metrics.jsonl; say what is missing
        summary["status"] = run.status = "failed"
        logger.error(f"summary.json not written: {e}; fix: free space there (the run's last checkpoint is "
                     f"{run.last_ckpt}{', its weights are in final/' if os.path.isdir(run.rd.file('final')) else ''})")
    mon = run.mon
    if run.ranks.is_main and mon.csv_path and os.path.exists(mon.csv_path):
        try:  # a picture must not fail a finished run
            plots.plot_memory(mon.csv_path, run.rd.file("memory.png"), mon.step_peaks, summary["predicted_gpu_bytes"],
                              summary["predicted_cpu_bytes"], mon.loop_start_s, run.rd.path)
        except Exception as e:  # noqa: BLE001 -- matplotlib raises many kinds; the run's data is all saved
            logger.warning(f"memory.png not written: {type(e).__name__}: {e}")
    if run.finished and run.sample_prompt:
        try:
            summary["sample"] = generate.run_sample(run.engine, run.sample_prompt, run.cfg, run.tokenizer,
                                                    run.spec.precision, run.rd.path, run.ranks.is_main)
        except Exception as e:  # noqa: BLE001 -- anything the sample raises; the trained weights are saved
            summary["sample_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning(f"the sample after training failed ({summary['sample_error']}); the run itself completed "
                           "and its weights are in final/")
        run.rd.write_json("summary.json", summary)
    for line in progress.summary_lines(summary):
        logger.info(line)
    run.engine.close()  # a DeepSpeed engine would otherwise stay in memory after the run (in-process callers)
    return summary


def _final_weights(run: Run) -> float | None:
    """The final eval loss (None without eval data), and final/ written for a finished run: from the best
    checkpoint by eval loss after an early stop, else the last weights. A full disk fails the run here."""
    st, cfg = run.st, run.cfg
    best = st.best_checkpoint if run.status == "stopped_early" and st.best_checkpoint and os.path.isdir(
        st.best_checkpoint) else None
    if best:
        run.engine.load(best)
        logger.info(f"final/ from the best checkpoint {best} (eval loss {st.best_eval_loss:.4f})")
    eval_loss = None
    if run.eval_data is not None:
        eval_loss = st.best_eval_loss if best else evaluate(run.engine, run.eval_data, run.spec.micro_batch,
                                                            run.ranks, cfg.eval.max_batches)
        if run.finished:
            ppl = perplexity(eval_loss, cfg.task)
            run.trackers.log({"eval_loss": eval_loss, **({"eval_perplexity": ppl} if ppl is not None else {})},
                             st.step)
    run.trackers.close()
    if run.finished and cfg.checkpoint.save:
        def write_final(tmp: str) -> None:
            run.engine.save_final(tmp)
            if run.tokenizer is not None and run.ranks.is_main:
                run.tokenizer.save_pretrained(tmp)
        try:
            with run.mon.host_phase("final"):
                ckpt.write_dir_atomic(run.rd.file("final"), write_final, what="final/ (the trained weights)",
                                      is_main=run.ranks.is_main, barrier=run.ranks.barrier)
        except DiskFull as e:
            run.status, run.diagnosis = "failed", disk_advice(e, run.rd, run.last_ckpt)
    return eval_loss


def summary_of(run: Run, eval_loss: float | None) -> dict:
    """summary.json: how the run ended, its speed (steps after the first, which pays one-time costs), its memory
    against the plan's, and every setting the plan chose."""
    st, spec, mon = run.st, run.spec, run.mon
    rows_after_first = run.rd.metrics()[1:] if run.ranks.is_main else []
    measured = [m["tokens_per_s"] for m in rows_after_first]
    in_loss = [m["tokens_in_loss_per_s"] for m in rows_after_first if m.get("tokens_in_loss_per_s") is not None]
    elapsed = max(run.elapsed, 1e-9)
    return {
        "status": run.status, "engine": run.engine.name, "profile": spec.profile.name, "precision": spec.precision,
        "device": str(run.device), "steps": st.step, "first_loss": st.first_loss, "final_loss": run.loss,
        "eval_loss": eval_loss,
        "eval_perplexity": perplexity(eval_loss, run.cfg.task),
        "best_eval_loss": st.best_eval_loss, "best_checkpoint": st.best_checkpoint,
        "tokens_per_s": (sum(measured) / len(measured)) if measured else st.tokens_seen / elapsed,
        "tokens_in_loss_per_s": (sum(in_loss) / len(in_loss)) if in_loss else st.tokens_in_loss / elapsed,
        "peak_gpu_bytes": mon.peak_gpu_bytes(), "peak_gpu_reserved_bytes": mon.peak_gpu_reserved_bytes(),
        "peak_cpu_rss_bytes": run.peak_rss, "peak_gpu_init_bytes": run.init_peak_gpu,
        "predicted_gpu_bytes": spec.predicted("gpu_bytes"), "predicted_cpu_bytes": spec.predicted("cpu_bytes"),
        "predicted_gpu_tensor_bytes": spec.predicted("gpu_tensor_bytes"),
        "skipped_steps": st.skipped, "loss_scale": run.last_scale, "fallbacks": st.fallbacks,
        "resumed_from": st.resumed_from, "optimizer": run.engine.optimizer_name, "micro_batch": spec.micro_batch,
        "accumulation": spec.accumulation, "gradient_checkpointing": spec.checkpointing,
        "checkpoint_every": spec.checkpoint_every, "world_size": run.ranks.world,
        "predicted_step_s": spec.predicted("step_s"), "calibration_doubtful": run.calibration_doubtful,
        "global_batch_size": run.cfg.train.global_batch_size, "task": run.cfg.task,
        "reference": run.objective.reference if run.objective is not None else None,
        **{f"final_{k}": v for k, v in (run.pref_metrics or {}).items()},
        "seq_len": run.cfg.data.seq_len, "elapsed_s": run.elapsed, "checkpoint": run.last_ckpt,
        **(run.startup.to_dict() if run.startup is not None else {"startup_s": None, "startup_parts": None}),
        "reasons": list(spec.reasons), "diagnosis": run.diagnosis, "run_dir": run.rd.path, "sample": None,
        "sample_error": None, "tracker_errors": run.trackers.failures, "threads": run.threads.to_dict(),
        **mon.summary(),
        # every rank's own high-water mark, for the planner's per-rank numbers (a finished run: all ranks are here)
        "peak_cpu_rss_hwm_bytes_per_rank": run.ranks.gather(mon.peak_rss_bytes())
        if run.ranks.world > 1 and run.finished else None,
    }


def prepare_run_dir(cfg: Config, ranks: dist.Dist, cleanup: contextlib.ExitStack
                    ) -> tuple[RunDir, str | None, str, list[tuple[str, str]]]:
    """(run directory, checkpoint to resume from or None, run name, damaged checkpoints newer than it).

    Nothing is overwritten: the directory is locked for this process first (``cleanup`` releases it), then
    the newest checkpoint whose files match its marker is chosen. Refusals leave everything as it was."""
    # ranks agree on the timestamp; a torchrun restart keeps the first start's
    run_name = cfg.run_name or ranks.broadcast(rankladder.restart_name(cfg.output_dir, ranks,
                                                                       default_run_name(cfg.model.name)))
    rd = RunDir(os.path.join(cfg.output_dir, run_name), ranks.is_main)
    problems, resume, damaged = None, None, []
    if ranks.is_main:  # rank 0 decides for all (the lock is one process's); the others hear its answer
        try:
            resume, damaged = _claim(cfg, rd, cleanup)
        except ConfigError as e:
            problems = e.problems
    problems, resume, damaged = ranks.broadcast((problems, resume, damaged))
    if problems:
        raise ConfigError(problems)
    rd.create()
    return rd, resume, run_name, damaged


def _claim(cfg: Config, rd: RunDir, cleanup: contextlib.ExitStack) -> tuple[str | None, list[tuple[str, str]]]:
    explicit = cfg.checkpoint.resume not in ("auto", "never")
    if explicit:  # before anything is made: a path that is not a usable checkpoint leaves no empty run behind
        why = ckpt.verify(cfg.checkpoint.resume)
        if why:
            near = ckpt.loadable_near(cfg.checkpoint.resume)
            raise ConfigError([f"checkpoint.resume: {cfg.checkpoint.resume} cannot be resumed from: {why}; rule: a "
                               "complete checkpoint (checkpoints/step-NNNNNN of a run) whose files match its marker; "
                               f"fix: checkpoint.resume={near or 'auto'}"])
    created = not os.path.isdir(rd.path)
    os.makedirs(rd.path, exist_ok=True)  # the lock lives inside
    lock = RunLock(rd.path)
    try:
        lock.acquire()
    except LockHeld as e:
        raise ConfigError([str(e)]) from None
    cleanup.callback(lock.release)
    if lock.taken_over:
        h = lock.taken_over
        logger.info(f"{LOCK}: taking over the lock of pid {h.get('pid', '?')} on host {h.get('host', '?')} "
                    f"(started {h.get('started', '?')}), which ended without releasing it")
    try:
        return _resume_point(cfg, rd, explicit)
    except ConfigError:
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(rd.path)  # only when empty
        raise


def _resume_point(cfg: Config, rd: RunDir, explicit: bool) -> tuple[str | None, list[tuple[str, str]]]:
    """In a locked run directory: (checkpoint to resume from or None, damaged ones newer than it)."""
    if not [n for n in os.listdir(rd.path) if n != LOCK]:
        return (cfg.checkpoint.resume if explicit else None), []
    if not explicit and failed_start(rd.path):  # nothing to resume: this start takes the directory over
        aside = set_aside_failed_start(rd.path)
        logger.info(f"run_name: {rd.path} holds a start that ended before its first checkpoint; this start takes it "
                    f"over" + (f" (what that start wrote is kept in {aside})" if aside else ""))
        return None, []
    if explicit:  # verified by _claim
        found, damaged = cfg.checkpoint.resume, []
    else:
        found, damaged = ckpt.newest_loadable(rd.checkpoints)
    for path, why in damaged:
        logger.warning(f"checkpoint {path} is damaged ({why})" + (f"; using {found}" if found else ""))
    if cfg.checkpoint.resume == "never" or found is None:
        what = "" if found is not None else (" whose checkpoints are all damaged" if damaged else
                                             " with no complete checkpoint")
        raise ConfigError([f"run_name: {rd.path} already holds a run{what}; rule: a run directory is never "
                           "overwritten; fix: choose another run_name"
                           + ("" if found is None else " or checkpoint.resume=auto to continue it")])
    try:
        summary = read_json(rd.file("summary.json")) if os.path.exists(rd.file("summary.json")) else {}
    except (OSError, ValueError):  # cut short by a kill or a full disk: the checkpoint says how far the run got
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    done = max(ckpt.read_marker(found)["step"], summary.get("steps") or 0)
    if summary.get("status") == "stopped_early":
        raise ConfigError([f"run_name: {rd.path} stopped early at step {summary.get('steps')} (no lower eval loss "
                           f"for train.early_stopping_patience evals); rule: a finished run is not overwritten; fix: "
                           "another run_name"])
    if summary.get("status") == "completed" and done >= cfg.train.max_steps:
        raise ConfigError([f"run_name: {rd.path} already completed {done} steps; rule: a finished run is not "
                           f"overwritten; fix: another run_name, or train.max_steps > {done} to continue it"])
    return found, damaged


def make_engine(cfg: Config, spec: RunSpec, hw: Hardware, hf_config, rd: RunDir, state: dict | None = None,
                startup: Startup | None = None, objective=None):
    """A model and engine for ``spec``. The model is made as the engine takes it (:mod:`launcher.model.materialize`):
    each weight once, in its training dtype, where it lives. With ``state`` (portable_state of the engine it
    replaces), those weights go in instead of being read or initialised, so low-precision copies are made from them."""
    model, materializer = build_model(
        cfg, engines.placement(spec, cfg.lora.r > 0), hf_config, precision=spec.precision,
        checkpointing=spec.checkpointing, checkpoint_every=spec.checkpoint_every,
        offload_activations=spec.offload_activations,
        pin_memory=spec.offload_activations and engines.offload_pinning(spec, hw)[0], overrides=state)
    if cfg.model.liger:  # checked before the run (kernels.check): a CUDA device and liger-kernel are there
        kernels.apply_liger(model)
    if cfg.model.compile:  # never on DeepSpeed: availability rules those profiles out
        logger.info(f"model.compile: {kernels.compile_layers(model)} decoder layers compiled in place "
                    "(compilation happens in the first steps)")
    engine, ds_config = engines.build(cfg, spec, model, hw, hf_config.hidden_size, lr_at(0, cfg.train),
                                      materializer=materializer, objective=objective)
    if materializer.checkpoint is not None:
        materializer.checkpoint.close()
    if startup is not None:
        made = materializer
        startup.lap("model and engine", f"{made.made_s:.1f} s making the weights: {made.loaded / GiB:.2f} GiB read, "
                                        f"{made.initialised / GiB:.2f} GiB initialised; the rest sharding, pinning "
                                        "and the engine's buffers")
    if ds_config is not None:
        rd.write_json("ds_config.json", ds_config)
    return engine, model


def disk_advice(e: OSError, rd: RunDir, last_ckpt: str | None) -> str:
    """The diagnosis of a run that a full disk stopped: what did not fit, and how to go on."""
    what = str(e) if isinstance(e, DiskFull) else disk_full_message(f"a write ({e})", rd.path)
    if last_ckpt:
        return (f"{what}; the last good checkpoint is {last_ckpt}; fix: free space on that disk (or lower "
                "checkpoint.keep_last), then run the same command again to resume from it")
    return (f"{what}; no checkpoint was written yet; fix: free space on that disk, or choose an output_dir on "
            "another, and start again with a new run_name")


_PROCESS: list = []  # this process's psutil handle, made once (making one reads /proc: tens of microseconds a step)


def memory_now(device: torch.device) -> dict:
    if not _PROCESS or _PROCESS[0].pid != os.getpid():
        _PROCESS[:] = [psutil.Process()]
    out = {"gpu_allocated_bytes": None, "gpu_reserved_bytes": None,
           "cpu_rss_bytes": _PROCESS[0].memory_info().rss}
    if device.type == "cuda":
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def perplexity(loss: float | None, task: str) -> float | None:
    """exp(loss) of a language model's eval loss; None without a loss or for a preference task (the exponential of
    a DPO loss means nothing)."""
    if loss is None or task != "causal_lm":
        return None
    return math.exp(loss) if loss < 700 else float("inf")


@torch.no_grad()
def evaluate(engine, data, micro_batch: int, ranks: dist.Dist, max_batches: int = 0) -> float:
    """Mean eval loss over the eval split, every sample once (``max_batches`` > 0: at most that many micro-batches
    per rank), weighted by the samples of each micro-batch. Every rank runs the same number of batches (ZeRO-3 and
    FSDP forwards are collective); a rank past the end repeats the last samples with weight 0."""
    n = len(data)
    per_round = micro_batch * ranks.world
    batches = max(1, -(-n // per_round))
    if max_batches:
        batches = min(batches, max_batches)
    total, weight = 0.0, 0
    for i in range(batches):
        start = (i * ranks.world + ranks.rank) * micro_batch
        idx = [j for j in range(start, start + micro_batch) if j < n]
        loss = engine.eval_loss(data.batch(idx or [n - 1]))
        total, weight = total + loss * len(idx), weight + len(idx)
    # sums over ranks (mean x world), so each sample weighs the same wherever it was evaluated
    return ranks.mean(total) / max(1e-12, ranks.mean(float(weight)))
