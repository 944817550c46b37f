"""The training loop. One loop for every engine; it reads top to bottom in :func:`train`.

decide (probe, resolve into a frozen RunSpec, plan) -> data -> run directory and resume point -> engine ->
for each step: micro-batches (forward + backward), step (clip, unscale, update), log, eval, checkpoint, OOM
ladder -> final weights, summary, sample.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import psutil
import torch

from launcher import engines, log
from launcher.config.profiles import PROFILES
from launcher.config.schema import Config, ConfigError, to_dict, to_yaml, with_epochs
from launcher.data import load_splits, settle_formats
from launcher.engines.base import StepResult, host_values
from launcher.engines.deepspeed import restore_torch_functions
from launcher.log import logger
from launcher.machine import diskspace, dist, threads
from launcher.machine.files import DiskFull, disk_full_message, is_disk_full, read_json
from launcher.machine.hardware import Hardware, enforce_gpu_budget, probe, with_nvme
from launcher.measure import calibrate
from launcher.model import hfconfig, kernels, lora
from launcher.model.build import build_model, count_params, enable_checkpointing, load_tokenizer, model_config
from launcher.plan import report
from launcher.plan.ladder import Rung, next_move
from launcher.plan.resolve import RunSpec, resolve
from launcher.precision import weight_dtype
from launcher.training import checkpoint as ckpt
from launcher.training import generate, plots, progress
from launcher.training.faults import Hooks, StopRequested, diagnose
from launcher.training.monitor import MemoryMonitor
from launcher.training.rundir import LOCK, LockHeld, RunDir, RunLock, default_run_name
from launcher.training.schedule import lr_at
from launcher.training.tracking import Trackers


@dataclass
class State:
    """What the loop carries from step to step and through a checkpoint."""

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


def train(cfg: Config, hooks: Hooks | None = None, hw: Hardware | None = None) -> dict:
    """Run one training job end to end. Returns the summary (also written to summary.json)."""
    try:
        with contextlib.ExitStack() as cleanup:  # the run directory's lock, released however the run ends
            return _train(cfg, hooks or Hooks(), hw, cleanup)
    finally:
        restore_torch_functions()


def _train(cfg: Config, hooks: Hooks, hw: Hardware | None, cleanup: contextlib.ExitStack) -> dict:
    ranks = dist.current()
    log.setup(cfg.log.level, ranks.rank)
    dist.init(torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"))
    hw = with_nvme(hw or probe(), cfg.memory.nvme_path)  # its free space and speed, for the plan
    # intra-op threads: the cores other processes leave free (launcher.machine.threads); several ranks on one machine
    # share its cores and start together (each would count the others as neighbours), so they split them
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    th = threads.decide(cfg.train.threads, max(1, threads.cores() // max(1, local)),
                        busy=0.0 if local > 1 else None)
    threads.apply(th)
    logger.info(f"threads: {th.intra_op} intra-op ({th.reason}); OMP_WAIT_POLICY {th.wait_policy}; data workers "
                f"{th.data_workers} (batches are cut from tokens in memory in the loop's thread)")
    # ---- decide everything before loading anything
    hf_config = model_config(cfg)
    hfconfig.check_weights(cfg.model.name)
    lora.check(cfg, hf_config)  # bitsandbytes present when needed; LoRA target names exist (on a meta model)
    asked = cfg  # what a checkpoint compares on resume: the settings as the user gave them
    cfg = settle_formats(cfg)  # format auto -> what the records hold (one record read), so the plan knows the batches
    # this machine's measured speeds, when `vramfit doctor --calibrate` has run: the plan then picks the
    # fastest predicted setting that fits (never measured here: a training start stays fast)
    spec = resolve(cfg, hw, ranks.world, ranks.local_rank, machine=calibrate.calibration(measure=False))
    for r in spec.reasons:
        logger.info(r)
    kernels.check(cfg, spec.device.type)  # model.liger where it cannot run
    seq_len = cfg.data.seq_len
    hfconfig.check_seq_len(hf_config, seq_len)  # the planner (in resolve) checked it too: one rule for plan and train
    # ---- tokenizer, data, sample prompt: input problems surface before the run directory exists
    tokenizer = load_tokenizer(cfg)
    train_data, eval_data = load_splits(cfg, hf_config.vocab_size, tokenizer, hf_config)
    if cfg.train.epochs:
        cfg = with_epochs(cfg, len(train_data))
        logger.info(f"train.epochs={cfg.train.epochs:g} over {len(train_data)} samples: {cfg.train.max_steps} steps "
                    f"of {cfg.train.global_batch_size}, warmup {cfg.train.warmup_steps}")
    sample_prompt = generate.prompt_ids(cfg, tokenizer, eval_data if eval_data is not None else train_data)
    if cfg.checkpoint.save:  # room for the checkpoints and final/ on the output disk, before anything is written
        disk = diskspace.room(cfg.output_dir, spec.predicted("checkpoint_bytes") or 0, spec.predicted("final_bytes") or 0,
                              cfg.checkpoint.keep_last + int(cfg.checkpoint.keep_best),
                              run_dir=os.path.join(cfg.output_dir, cfg.run_name) if cfg.run_name else None)
        problem = diskspace.refusal(disk, cfg.lora.r)
        if problem:
            raise ConfigError([problem], "disk plan")
        logger.info(diskspace.describe(disk))
    rd, resume_from, run_name, damaged = prepare_run_dir(cfg, ranks, cleanup)
    settings = ckpt.fixed_settings(asked)
    if resume_from:
        marker = ckpt.read_marker(resume_from)
        diff = ckpt.diff_settings(marker["settings"], settings)
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
        spec = spec.at(rung)  # continue where the OOM ladder had got to
        if "files" not in marker:
            logger.info(f"checkpoint {resume_from} was written before checkpoints carried checksums: not verified")
        rd.hold()  # nothing is written into the run being continued until its checkpoint has loaded
    rd.write_text("config.yaml", to_yaml(replace(cfg, run_name=run_name, model=replace(
        cfg.model, gradient_checkpointing=spec.checkpointing, checkpoint_every=spec.checkpoint_every))))
    if spec.plan is not None:
        rd.write_json("plan.json", spec.plan.to_json())
    device = spec.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        capped = enforce_gpu_budget(cfg.memory.gpu_budget, device)
        if capped:
            logger.info(capped)
    mon = MemoryMonitor.for_run(cfg, rd, device)  # stopped in the loop's finally
    if not resume_from:
        mon.start()  # memory.csv from here (a resume appends to it once its checkpoint has loaded)
    # ---- model, engine
    engine, model = make_engine(cfg, spec, hw, hf_config, rd)
    init_peak_gpu = None
    if device.type == "cuda":  # engine set-up can briefly hold two copies of the weights; training is measured apart
        init_peak_gpu = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    n_total, n_train = count_params(model)
    logger.info(f"model {cfg.model.name}: {n_total / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable); "
                f"data: {len(train_data)} samples of up to {seq_len} tokens, {train_data.description}")
    logger.info(f"engine {engine.name}, profile {spec.profile.name}, optimizer {engine.optimizer_name}, micro-batch "
                f"{spec.micro_batch} x accumulation {spec.accumulation} x {ranks.world} rank(s) = "
                f"{cfg.train.global_batch_size}")
    # ---- resume
    st = State()
    if resume_from:
        try:
            client = engine.load(resume_from)
        except Exception as e:  # noqa: BLE001 -- each engine's loader fails its own way (torch, DeepSpeed, DCP)
            engine.close()
            older = ckpt.older_loadable(resume_from)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError([f"checkpoint.resume: {resume_from} matches its recorded sizes and checksums but does "
                               f"not load ({type(e).__name__}: {first}); rule: a checkpoint that this engine wrote for "
                               "this model; fix: " + (f"checkpoint.resume={older}" if older else "another run_name (no "
                               "older checkpoint loads)") + "; nothing in the run directory was changed"]) from None
        st.step, st.first_loss, st.skipped = client["step"], client.get("first_loss"), client.get("skipped", 0)
        st.fallbacks, st.tokens_seen = client.get("fallbacks", []), client.get("tokens_seen", 0)
        st.tokens_in_loss = client.get("tokens_in_loss", 0)
        st.best_eval_loss, st.best_checkpoint = client.get("best_eval_loss"), client.get("best_checkpoint")
        st.evals_since_best = client.get("evals_since_best", 0)
        rng = client["rng"]
        ckpt.set_rng_state(rng[min(ranks.rank, len(rng) - 1)] if isinstance(rng, list) else rng)
        st.resumed_from = resume_from
        if ranks.is_main:
            for path, _why in damaged:  # out of the resume and rotation order, kept for a look
                logger.info(f"damaged checkpoint {path} kept as {ckpt.set_aside(path)}")
        rd.truncate_metrics(st.step)
        rd.commit()
        mon.start()
        logger.info(f"resumed from {resume_from} at step {st.step}")

    def save_checkpoint() -> str:
        client = {"step": st.step, "samples_seen": st.step * cfg.train.global_batch_size, "first_loss": st.first_loss,
                  "skipped": st.skipped, "fallbacks": st.fallbacks, "tokens_seen": st.tokens_seen,
                  "tokens_in_loss": st.tokens_in_loss, "best_eval_loss": st.best_eval_loss,
                  "best_checkpoint": st.best_checkpoint, "evals_since_best": st.evals_since_best,
                  "rng": ranks.gather(ckpt.rng_state())}
        path = ckpt.save(engine, rd.checkpoints, st.step, client, settings, is_main=ranks.is_main,
                         barrier=ranks.barrier, keep_last=cfg.checkpoint.keep_last, extra={"rung": asdict(spec.rung)},
                         during_save=hooks.during_save, predicted_bytes=spec.predicted("checkpoint_bytes"),
                         keep=(st.best_checkpoint,) if cfg.checkpoint.keep_best and st.best_checkpoint else ())
        logger.info(f"checkpoint {path}")
        return path

    def save_periodic() -> bool:
        """A checkpoint on the way that does not fit on the disk is skipped with a warning (its partial files are
        already gone) and the run goes on; the last one must fit (DiskFull ends the run as failed, with the last
        good checkpoint). Returns whether it was written."""
        try:
            save_checkpoint()
            return True
        except DiskFull as e:
            logger.warning(f"checkpoint at step {st.step} skipped: {e}; the run goes on, the last good checkpoint is "
                           f"{ckpt.latest(rd.checkpoints) or 'none yet'}; fix: free space there or lower "
                           "checkpoint.keep_last")
            return False

    def run_eval() -> bool:
        """Eval loss and perplexity now; the best is kept (checkpoint.keep_best). True when the run should stop
        (train.early_stopping_patience evals in a row without a lower loss)."""
        ev = evaluate(engine, eval_data, spec.micro_batch, ranks, cfg.eval.max_batches)
        improved = st.best_eval_loss is None or ev < st.best_eval_loss
        if improved:
            st.best_eval_loss, st.evals_since_best = ev, 0
        else:
            st.evals_since_best += 1
        logger.info(f"eval loss {ev:.4f}, perplexity {perplexity(ev):.4g} at step {st.step}"
                    + (" (best so far)" if improved else f" (best {st.best_eval_loss:.4f}; {st.evals_since_best} "
                                                         "without improvement)"))
        trackers.log({"eval_loss": ev, "eval_perplexity": perplexity(ev), "eval_best_loss": st.best_eval_loss},
                     st.step)
        if improved and cfg.checkpoint.keep_best and cfg.checkpoint.save:
            previous, st.best_checkpoint = st.best_checkpoint, ckpt.step_dir(rd.checkpoints, st.step)
            if not save_periodic():  # the checkpoint recorded itself as the best; it was not written
                st.best_checkpoint = previous
        patience = cfg.train.early_stopping_patience
        return bool(patience) and st.evals_since_best >= patience

    # ---- trackers: only once a resume has loaded (a refused one changes nothing in the run directory)
    trackers = Trackers(cfg.log.report_to, rd.path, run_name, to_dict(cfg), ranks.is_main, warn=logger.warning,
                        folder=cfg.log.tracker_dir)  # closed after the loop; one that fails is switched off
    cleanup.callback(trackers.close)  # and when the run ends with an exception
    if spec.plan is not None:
        trackers.text("plan", report.format_table(spec.plan))

    # ---- the loop
    stop = StopRequested().install()
    status, diagnosis, last_ckpt = "completed", None, None
    t_start = time.perf_counter()
    peak_rss = psutil.Process().memory_info().rss
    loss, at_min_scale, last_scale = float("nan"), 0, None  # last_scale: fp16 loss scale after the last step
    bar = progress.Progress(cfg, st.step, ranks.is_main)
    try:
        while st.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(st.step, cfg.train)
            move = None
            try:
                if hooks.before_step:
                    hooks.before_step(st.step, engine)
                mon.mark("forward", engine)  # model hooks split forward from backward
                batch = train_data.step(st.step, cfg.train.global_batch_size, spec.micro_batch, ranks.rank,
                                        ranks.world, cfg.seed)  # this rank's micro-batches: stacked, padded or packed
                losses = [engine.forward_backward(b, spec.accumulation) for b in batch.batches]
                if hooks.after_backward:
                    hooks.after_backward(st.step, engine)
                mon.mark("step")
                # The engine skips an update whose gradients hold inf/nan by itself (a nan loss makes them so),
                # so the loss is read after the update is queued, with the step's other numbers, in one host
                # transfer: a GPU waits for the host once per step, not at the loss and again at the norm.
                result: StepResult = engine.step(lr)
                loss, skipped, scale, norm = host_values([torch.stack(losses).mean(), result.skipped,
                                                          result.loss_scale, result.grad_norm])
                result = StepResult(skipped=bool(skipped), loss_scale=scale, grad_norm=norm)
                loss = ranks.mean(loss)
                last_scale = result.loss_scale
                if not math.isfinite(loss) and spec.precision != "fp16":  # its update was not applied
                    status, diagnosis = "failed", diagnose(engine, train_data, spec.rung, st.step, cfg, lr,
                                                           f"loss became {loss} at step {st.step + 1}")
                    break
            except torch.OutOfMemoryError:  # anything else propagates untouched
                # One process only: with several ranks the others wait in a collective of this step and
                # cannot take part in a move (portable_state and a new engine are collectives too).
                move = next_move(spec.rung, list(spec.usable)) if cfg.train.oom_fallback and ranks.world == 1 else None
                if move is None:
                    if ranks.world > 1 and cfg.train.oom_fallback:
                        logger.info(f"OOM at step {st.step + 1} on rank {ranks.rank}: the OOM ladder runs in "
                                    "single-process runs only; resume from the last checkpoint with a smaller "
                                    "train.micro_batch_size", extra={"all_ranks": True})
                    raise
            if move is not None:
                # Out of the except block: until it ends, the exception's traceback keeps the failed step's
                # frames, and with them its activations and the engine, from being freed.
                logger.info(f"OOM at step {st.step + 1}: {move.reason}")
                st.fallbacks.append({"from": asdict(spec.rung), "to": asdict(move.to), "reason": move.reason,
                                     "step": st.step + 1})
                new_spec = spec.at(move.to)
                if move.kind == "profile" or not engine.resets_in_place:  # rebuild from the last state
                    state, scale_state = engine.portable_state(), engine.loss_scale_state()
                    engine.close()  # DeepSpeed keeps references (hooks) that would outlive the object
                    mon.unwatch()
                    engine = model = None
                    free_memory(device)
                    engine, model = make_engine(cfg, new_spec, hw, hf_config, rd, state)
                    engine.load_portable_state(state, st.step - st.skipped, scale_state)
                    del state
                else:
                    engine.reset_micro_batch(move.to.micro_batch, move.to.accumulation)
                    if move.kind == "checkpointing":
                        enable_checkpointing(engine.module(), move.to.checkpoint_every, spec.offload_activations,
                                             engine.levers is not None and engine.levers.pin_memory)
                        if engine.levers is not None:  # activation offload now rides on the checkpointed layers
                            engine.levers = replace(engine.levers, checkpointing=True)
                    free_memory(device)
                spec = new_spec
                continue
            st.step += 1
            st.tokens_seen += batch.tokens
            st.tokens_in_loss += batch.tokens_in_loss
            st.skipped += int(result.skipped)
            if st.first_loss is None:
                st.first_loss = loss
            dt = time.perf_counter() - t0
            mem = memory_now(device)
            peak_rss = max(peak_rss, mem["cpu_rss_bytes"])
            row = {"step": st.step, "loss": loss, "lr": lr, "loss_scale": result.loss_scale,
                   "skipped": result.skipped, "grad_norm": result.grad_norm, "tokens": st.tokens_seen,
                   "tokens_per_s": batch.tokens / dt, "tokens_in_loss": st.tokens_in_loss,
                   "tokens_in_loss_per_s": batch.tokens_in_loss / dt, **mem, "time_s": time.perf_counter() - t_start,
                   "micro_batch": spec.micro_batch, **mon.end_step(st.step, mem)}
            rd.append_metrics(row)
            trackers.log(row, st.step)
            bar.update(row)  # a bar on a terminal, else a log line every log.every_steps
            # fp16 that keeps overflowing at the minimum scale will never train: stop with a diagnosis
            at_min = result.skipped and result.loss_scale is not None and result.loss_scale <= cfg.loss_scale.min_scale
            at_min_scale = at_min_scale + 1 if at_min else 0
            if at_min_scale >= cfg.loss_scale.patience:
                status, diagnosis = "failed", diagnose(
                    engine, train_data, spec.rung, st.step, cfg, lr,
                    f"{at_min_scale} steps in a row overflowed at the minimum loss scale {cfg.loss_scale.min_scale:g}")
                break
            saved_here = False
            if eval_data is not None and cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                if run_eval():
                    status = "stopped_early"
                    logger.info(f"early stop at step {st.step}: {st.evals_since_best} evals without a lower eval loss "
                                f"than {st.best_eval_loss:.4f}")
                    break
                saved_here = st.best_checkpoint == ckpt.step_dir(rd.checkpoints, st.step)
            if hooks.after_step:
                hooks.after_step(st.step)
            if ranks.any(bool(stop)):  # ranks agree, so all of them save the same step
                status = "interrupted"
                break
            if (cfg.checkpoint.save and cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0
                    and st.step < cfg.train.max_steps and not saved_here):
                save_periodic()
        last_ckpt = save_checkpoint() if cfg.checkpoint.save else None
    except OSError as e:  # a full disk ends the run as failed, with a summary and the last good checkpoint
        if not isinstance(e, DiskFull) and not is_disk_full(e, rd.path):
            raise
        status, last_ckpt = "failed", ckpt.latest(rd.checkpoints)
        diagnosis = disk_advice(e, rd, last_ckpt)
    finally:
        stop.restore()
        rd.close()
        bar.close()
        mon.stop()
    elapsed = time.perf_counter() - t_start
    # ---- outputs: the run is finished and recorded (final/, summary) before the sample after training
    best = st.best_checkpoint if status == "stopped_early" and st.best_checkpoint and os.path.isdir(
        st.best_checkpoint) else None
    if best:  # final/ from the best weights by eval loss
        engine.load(best)
        logger.info(f"final/ from the best checkpoint {best} (eval loss {st.best_eval_loss:.4f})")
    eval_loss = (st.best_eval_loss if best else evaluate(engine, eval_data, spec.micro_batch, ranks,
                                                         cfg.eval.max_batches)) if eval_data is not None else None
    if eval_data is not None and status in ("completed", "stopped_early"):
        trackers.log({"eval_loss": eval_loss, "eval_perplexity": perplexity(eval_loss)}, st.step)
    trackers.close()
    if status in ("completed", "stopped_early") and cfg.checkpoint.save:
        def write_final(tmp: str) -> None:
            engine.save_final(tmp)
            if tokenizer is not None and ranks.is_main:
                tokenizer.save_pretrained(tmp)
        try:
            ckpt.write_dir_atomic(rd.file("final"), write_final, what="final/ (the trained weights)",
                                  is_main=ranks.is_main, barrier=ranks.barrier)
        except DiskFull as e:
            status, diagnosis = "failed", disk_advice(e, rd, last_ckpt)
    if diagnosis:
        (logger.error if status == "failed" else logger.info)(f"stopped: {diagnosis}")
    rows_after_first = rd.metrics()[1:] if ranks.is_main else []  # the first step pays one-time costs
    measured = [m["tokens_per_s"] for m in rows_after_first]
    in_loss = [m["tokens_in_loss_per_s"] for m in rows_after_first if m.get("tokens_in_loss_per_s") is not None]
    summary = {
        "status": status, "engine": engine.name, "profile": spec.profile.name, "precision": spec.precision,
        "device": str(device), "steps": st.step, "first_loss": st.first_loss, "final_loss": loss,
        "eval_loss": eval_loss, "eval_perplexity": perplexity(eval_loss) if eval_loss is not None else None,
        "best_eval_loss": st.best_eval_loss, "best_checkpoint": st.best_checkpoint,
        "tokens_per_s": (sum(measured) / len(measured)) if measured else st.tokens_seen / max(elapsed, 1e-9),
        "tokens_in_loss_per_s": (sum(in_loss) / len(in_loss)) if in_loss else st.tokens_in_loss / max(elapsed, 1e-9),
        "peak_gpu_bytes": mon.peak_gpu_bytes(), "peak_gpu_reserved_bytes": mon.peak_gpu_reserved_bytes(),
        "peak_cpu_rss_bytes": peak_rss,
        "peak_gpu_init_bytes": init_peak_gpu,
        "predicted_gpu_bytes": spec.predicted("gpu_bytes"), "predicted_cpu_bytes": spec.predicted("cpu_bytes"),
        "predicted_gpu_tensor_bytes": spec.predicted("gpu_tensor_bytes"),
        "skipped_steps": st.skipped, "loss_scale": last_scale, "fallbacks": st.fallbacks, "resumed_from": st.resumed_from,
        "optimizer": engine.optimizer_name, "micro_batch": spec.micro_batch, "accumulation": spec.accumulation,
        "gradient_checkpointing": spec.checkpointing, "checkpoint_every": spec.checkpoint_every,
        "world_size": ranks.world, "predicted_step_s": spec.predicted("step_s"),
        "global_batch_size": cfg.train.global_batch_size, "seq_len": seq_len, "elapsed_s": elapsed,
        "checkpoint": last_ckpt, "reasons": list(spec.reasons), "diagnosis": diagnosis, "run_dir": rd.path,
        "sample": None, "sample_error": None, "tracker_errors": trackers.failures, "threads": th.to_dict(), **mon.summary(),
    }
    try:
        rd.write_json("summary.json", summary)
    except DiskFull as e:  # the run's state is in its last checkpoint and metrics.jsonl; say what is missing
        summary["status"] = status = "failed"
        logger.error(f"summary.json not written: {e}; fix: free space there (the run's last checkpoint is "
                     f"{last_ckpt}{', its weights are in final/' if os.path.isdir(rd.file('final')) else ''})")
    if ranks.is_main and mon.csv_path and os.path.exists(mon.csv_path):
        try:  # a picture must not fail a finished run
            plots.plot_memory(mon.csv_path, rd.file("memory.png"), mon.step_peaks, summary["predicted_gpu_bytes"],
                              summary["predicted_cpu_bytes"], mon.loop_start_s, rd.path)
        except Exception as e:  # noqa: BLE001 -- matplotlib raises many kinds; the run's data is all saved
            logger.warning(f"memory.png not written: {type(e).__name__}: {e}")
    # The sample is a courtesy: one that fails is a warning in the summary, never a failed run.
    if status in ("completed", "stopped_early") and sample_prompt:
        try:
            summary["sample"] = generate.run_sample(engine, sample_prompt, cfg, tokenizer, spec.precision, rd.path,
                                                    ranks.is_main)
        except Exception as e:  # noqa: BLE001 -- anything the sample raises; the trained weights are saved
            summary["sample_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning(f"the sample after training failed ({summary['sample_error']}); the run itself completed "
                           "and its weights are in final/")
        rd.write_json("summary.json", summary)
    for line in progress.summary_lines(summary):
        logger.info(line)
    engine.close()  # a DeepSpeed engine would otherwise stay in memory after the run (in-process callers)
    return summary


def prepare_run_dir(cfg: Config, ranks: dist.Dist, cleanup: contextlib.ExitStack
                    ) -> tuple[RunDir, str | None, str, list[tuple[str, str]]]:
    """(run directory, checkpoint to resume from or None, run name, damaged checkpoints newer than it).

    Nothing is overwritten: the directory is locked for this process first (``cleanup`` releases it), then
    the newest checkpoint whose files match its marker is chosen. Refusals leave everything as it was."""
    run_name = cfg.run_name or ranks.broadcast(default_run_name(cfg.model.name))  # ranks agree on the timestamp
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
    summary = read_json(rd.file("summary.json")) if os.path.exists(rd.file("summary.json")) else {}
    done = max(ckpt.read_marker(found)["step"], summary.get("steps") or 0)
    if summary.get("status") == "stopped_early":
        raise ConfigError([f"run_name: {rd.path} stopped early at step {summary.get('steps')} (no lower eval loss "
                           f"for train.early_stopping_patience evals); rule: a finished run is not overwritten; fix: "
                           "another run_name"])
    if summary.get("status") == "completed" and done >= cfg.train.max_steps:
        raise ConfigError([f"run_name: {rd.path} already completed {done} steps; rule: a finished run is not "
                           f"overwritten; fix: another run_name, or train.max_steps > {done} to continue it"])
    return found, damaged


def make_engine(cfg: Config, spec: RunSpec, hw: Hardware, hf_config, rd: RunDir, state: dict | None = None):
    """A model and engine for ``spec``. With ``state`` (portable_state of the engine it replaces), the weights
    go into the model before the engine wraps it, so low-precision copies are made from them."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, weight_dtype(spec.engine, spec.precision, cfg.lora.r > 0), hf_config, device=spec.device,
                        precision=spec.precision, checkpointing=spec.checkpointing,
                        checkpoint_every=spec.checkpoint_every, offload_activations=spec.offload_activations,
                        pin_memory=spec.offload_activations and engines.offload_pinning(spec, hw)[0])
    if state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in state:
                    p.copy_(state[name]["param"])
    if cfg.model.liger:  # checked before the run (kernels.check): a CUDA device and liger-kernel are there
        kernels.apply_liger(model)
    if cfg.model.compile:  # never on DeepSpeed: availability rules those profiles out
        logger.info(f"model.compile: {kernels.compile_layers(model)} decoder layers compiled in place "
                    "(compilation happens in the first steps)")
    engine, ds_config = engines.build(cfg, spec, model, hw, hf_config.hidden_size, lr_at(0, cfg.train))
    if ds_config is not None:
        rd.write_json("ds_config.json", ds_config)
    return engine, model


_PROCESS: list = []  # this process's psutil handle, made once (making one reads /proc: tens of microseconds a step)
def disk_advice(e: OSError, rd: RunDir, last_ckpt: str | None) -> str:
    """The diagnosis of a run that a full disk stopped: what did not fit, and how to go on."""
    what = str(e) if isinstance(e, DiskFull) else disk_full_message(f"a write ({e})", rd.path)
    if last_ckpt:
        return (f"{what}; the last good checkpoint is {last_ckpt}; fix: free space on that disk (or lower "
                "checkpoint.keep_last), then run the same command again to resume from it")
    return (f"{what}; no checkpoint was written yet; fix: free space on that disk, or choose an output_dir on "
            "another, and start again with a new run_name")


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


def perplexity(loss: float) -> float:
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
