"""The training loop. One loop for every engine, in three steps around one :class:`launcher.training.state.Run` record.

:func:`launcher.training.prepare.prepare` decides everything before anything loads (probe, resolve into a frozen
RunSpec, plan), loads the data, claims the run directory and its resume point, builds the engine and restores a
checkpoint; :func:`fit` runs the steps (micro-batches forward + backward, the engine's step, log, eval, checkpoint,
the OOM ladder); :func:`launcher.training.finish.finish` writes what the run leaves behind (final weights, summary,
plot, a sample).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from dataclasses import asdict

import psutil
import torch

from launcher import engines
from launcher.config.schema import Config
from launcher.engines.base import StepResult, host_values
from launcher.log import logger
from launcher.machine.files import DiskFull, is_disk_full
from launcher.machine.hardware import Hardware
from launcher.model import preference
from launcher.plan.ladder import Move, next_move
from launcher.training import checkpoint as ckpt
from launcher.training import evaluation, progress, rankladder
from launcher.training.evaluation import perplexity
from launcher.training.faults import Hooks, StopRequested, diagnose
from launcher.training.finish import disk_advice, finish
from launcher.training.prepare import make_engine, prepare
from launcher.training.schedule import lr_at
from launcher.training.state import Run


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
    ev = evaluation.evaluate(run.engine, run.eval_data, run.spec.micro_batch, run.ranks, cfg.eval.max_batches)
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

