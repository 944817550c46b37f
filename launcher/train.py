"""The training loop. One loop for every engine; it reads top to bottom in :func:`train`.

decide (probe, resolve into a frozen RunSpec, plan) -> data -> run directory and resume point -> engine ->
for each step: micro-batches (forward + backward), step (clip, unscale, update), log, eval, checkpoint, OOM
ladder -> final weights, summary, sample.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import psutil
import torch

from launcher import checkpoint as ckpt
from launcher import dist, engines, generate, log, lora, plots, progress
from launcher.config import Config, ConfigError, to_yaml
from launcher.data import load_splits, settle_formats
from launcher.engines.base import StepResult
from launcher.engines.deepspeed import restore_torch_functions
from launcher.faults import Hooks, StopRequested, diagnose
from launcher.hardware import Hardware, enforce_gpu_budget, probe
from launcher.ladder import Rung, next_move
from launcher.log import logger
from launcher.models import build_model, count_params, enable_checkpointing, load_tokenizer, model_config, weight_dtype
from launcher.monitor import MemoryMonitor
from launcher.resolve import RunSpec, resolve
from launcher.rundir import RunDir, default_run_name, read_json
from launcher.schedule import lr_at


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


def train(cfg: Config, hooks: Hooks | None = None, hw: Hardware | None = None) -> dict:
    """Run one training job end to end. Returns the summary (also written to summary.json)."""
    try:
        return _train(cfg, hooks or Hooks(), hw)
    finally:
        restore_torch_functions()


def _train(cfg: Config, hooks: Hooks, hw: Hardware | None) -> dict:
    ranks = dist.current()
    log.setup(cfg.log.level, ranks.rank)
    dist.init(torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"))
    hw = hw or probe()
    # ---- decide everything before loading anything
    hf_config = model_config(cfg)
    lora.check(cfg, hf_config)  # bitsandbytes present when needed; LoRA target names exist (on a meta model)
    asked = cfg  # what a checkpoint compares on resume: the settings as the user gave them
    cfg = settle_formats(cfg)  # format auto -> what the records hold (one record read), so the plan knows the batches
    spec = resolve(cfg, hw, ranks.world, ranks.local_rank)
    for r in spec.reasons:
        logger.info(r)
    seq_len = cfg.data.seq_len
    max_pos = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if max_pos and seq_len > max_pos:
        raise ConfigError([f"data.seq_len: got {seq_len}; rule: at most the model's maximum of {max_pos} positions; "
                           f"fix: data.seq_len={max_pos}"])
    # ---- tokenizer, data, sample prompt: input problems surface before the run directory exists
    tokenizer = load_tokenizer(cfg)
    train_data, eval_data = load_splits(cfg, hf_config.vocab_size, tokenizer, hf_config)
    sample_prompt = generate.prompt_ids(cfg, tokenizer, eval_data if eval_data is not None else train_data)
    rd, resume_from, run_name = prepare_run_dir(cfg, ranks)
    settings = ckpt.fixed_settings(asked)
    if resume_from:
        marker = ckpt.read_marker(resume_from)
        diff = ckpt.diff_settings(marker["settings"], settings)
        if diff:
            raise ConfigError([f"checkpoint {resume_from}: settings changed since it was written; rule: these must "
                               f"match to resume; fix: restore them or choose another run_name. Changes: {'; '.join(diff)}"])
        if marker.get("rung"):  # continue where the OOM ladder had got to
            spec = spec.at(Rung(**marker["rung"]))
    rd.write_text("config.yaml", to_yaml(replace(cfg, run_name=run_name, model=replace(
        cfg.model, gradient_checkpointing=spec.checkpointing))))
    if spec.plan is not None:
        rd.write_json("plan.json", spec.plan.to_json())
    device = spec.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        capped = enforce_gpu_budget(cfg.memory.gpu_budget, device)
        if capped:
            logger.info(capped)
    mon = MemoryMonitor.for_run(cfg, rd, device).start()  # memory.csv from here; stopped in the loop's finally
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
        client = engine.load(resume_from)
        st.step, st.first_loss, st.skipped = client["step"], client.get("first_loss"), client.get("skipped", 0)
        st.fallbacks, st.tokens_seen = client.get("fallbacks", []), client.get("tokens_seen", 0)
        st.tokens_in_loss = client.get("tokens_in_loss", 0)
        rng = client["rng"]
        ckpt.set_rng_state(rng[min(ranks.rank, len(rng) - 1)] if isinstance(rng, list) else rng)
        st.resumed_from = resume_from
        rd.truncate_metrics(st.step)
        logger.info(f"resumed from {resume_from} at step {st.step}")

    def save_checkpoint() -> str:
        client = {"step": st.step, "samples_seen": st.step * cfg.train.global_batch_size, "first_loss": st.first_loss,
                  "skipped": st.skipped, "fallbacks": st.fallbacks, "tokens_seen": st.tokens_seen,
                  "tokens_in_loss": st.tokens_in_loss,
                  "rng": ranks.gather(ckpt.rng_state())}
        path = ckpt.save(engine, rd.checkpoints, st.step, client, settings, is_main=ranks.is_main,
                         barrier=ranks.barrier, keep_last=cfg.checkpoint.keep_last, extra={"rung": asdict(spec.rung)},
                         during_save=hooks.during_save)
        logger.info(f"checkpoint {path}")
        return path

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
                loss = ranks.mean(float(torch.stack(losses).mean()))
                if hooks.after_backward:
                    hooks.after_backward(st.step, engine)
                if not math.isfinite(loss) and spec.precision != "fp16":
                    status, diagnosis = "failed", diagnose(engine, train_data, spec.rung, st.step, cfg, lr,
                                                           f"loss became {loss} at step {st.step + 1}")
                    engine.reset_micro_batch(spec.micro_batch, spec.accumulation)  # never apply that update
                    break
                mon.mark("step")
                result: StepResult = engine.step(lr)
                last_scale = result.loss_scale
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
                    state = engine.portable_state()
                    engine.close()  # DeepSpeed keeps references (hooks) that would outlive the object
                    mon.unwatch()
                    engine = model = None
                    free_memory(device)
                    engine, model = make_engine(cfg, new_spec, hw, hf_config, rd, state, last_scale)
                    engine.load_portable_state(state, st.step - st.skipped)
                    del state
                else:
                    engine.reset_micro_batch(move.to.micro_batch, move.to.accumulation)
                    if move.kind == "checkpointing":
                        enable_checkpointing(engine.module())
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
            bar.update(row)  # a bar on a terminal, else a log line every log.every_steps
            # fp16 that keeps overflowing at the minimum scale will never train: stop with a diagnosis
            at_min = result.skipped and result.loss_scale is not None and result.loss_scale <= cfg.loss_scale.min_scale
            at_min_scale = at_min_scale + 1 if at_min else 0
            if at_min_scale >= cfg.loss_scale.patience:
                status, diagnosis = "failed", diagnose(
                    engine, train_data, spec.rung, st.step, cfg, lr,
                    f"{at_min_scale} steps in a row overflowed at the minimum loss scale {cfg.loss_scale.min_scale:g}")
                break
            if eval_data is not None and cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                logger.info(f"eval loss {evaluate(engine, eval_data, spec.micro_batch, ranks):.4f} at step {st.step}")
            if hooks.after_step:
                hooks.after_step(st.step)
            if ranks.any(bool(stop)):  # ranks agree, so all of them save the same step
                status = "interrupted"
                break
            if (cfg.checkpoint.save and cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0
                    and st.step < cfg.train.max_steps):
                save_checkpoint()
        last_ckpt = save_checkpoint() if cfg.checkpoint.save else None
    finally:
        stop.restore()
        rd.close()
        bar.close()
        mon.stop()
    elapsed = time.perf_counter() - t_start
    # ---- outputs: the run is finished and recorded (final/, summary) before the sample after training
    eval_loss = evaluate(engine, eval_data, spec.micro_batch, ranks) if eval_data is not None else None
    if status == "completed" and cfg.checkpoint.save:
        engine.save_final(rd.file("final"))
        if tokenizer is not None and ranks.is_main:
            tokenizer.save_pretrained(rd.file("final"))
    if diagnosis:
        logger.info(f"stopped: {diagnosis}")
    rows_after_first = rd.metrics()[1:] if ranks.is_main else []  # the first step pays one-time costs
    measured = [m["tokens_per_s"] for m in rows_after_first]
    in_loss = [m["tokens_in_loss_per_s"] for m in rows_after_first if m.get("tokens_in_loss_per_s") is not None]
    summary = {
        "status": status, "engine": engine.name, "profile": spec.profile.name, "precision": spec.precision,
        "device": str(device), "steps": st.step, "first_loss": st.first_loss, "final_loss": loss,
        "eval_loss": eval_loss,
        "tokens_per_s": (sum(measured) / len(measured)) if measured else st.tokens_seen / max(elapsed, 1e-9),
        "tokens_in_loss_per_s": (sum(in_loss) / len(in_loss)) if in_loss else st.tokens_in_loss / max(elapsed, 1e-9),
        "peak_gpu_bytes": mon.peak_gpu_bytes(), "peak_gpu_reserved_bytes": mon.peak_gpu_reserved_bytes(),
        "peak_cpu_rss_bytes": peak_rss,
        "peak_gpu_init_bytes": init_peak_gpu,
        "predicted_gpu_bytes": spec.predicted("gpu_bytes"), "predicted_cpu_bytes": spec.predicted("cpu_bytes"),
        "predicted_gpu_tensor_bytes": spec.predicted("gpu_tensor_bytes"),
        "skipped_steps": st.skipped, "fallbacks": st.fallbacks, "resumed_from": st.resumed_from,
        "optimizer": engine.optimizer_name, "micro_batch": spec.micro_batch, "accumulation": spec.accumulation,
        "gradient_checkpointing": spec.checkpointing, "world_size": ranks.world,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": seq_len, "elapsed_s": elapsed,
        "checkpoint": last_ckpt, "reasons": list(spec.reasons), "diagnosis": diagnosis, "run_dir": rd.path,
        "sample": None, "sample_error": None, **mon.summary(),
    }
    rd.write_json("summary.json", summary)
    if ranks.is_main and mon.csv_path and os.path.exists(mon.csv_path):
        try:  # a picture must not fail a finished run
            plots.plot_memory(mon.csv_path, rd.file("memory.png"), mon.step_peaks, summary["predicted_gpu_bytes"],
                              summary["predicted_cpu_bytes"], mon.loop_start_s, rd.path)
        except Exception as e:  # noqa: BLE001 -- matplotlib raises many kinds; the run's data is all saved
            logger.warning(f"memory.png not written: {type(e).__name__}: {e}")
    # The sample is a courtesy: one that fails is a warning in the summary, never a failed run.
    if status == "completed" and sample_prompt:
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


def prepare_run_dir(cfg: Config, ranks: dist.Dist) -> tuple[RunDir, str | None, str]:
    """(run directory, checkpoint to resume from or None, run name). Nothing is overwritten."""
    run_name = cfg.run_name or ranks.broadcast(default_run_name(cfg.model.name))  # ranks agree on the timestamp
    rd = RunDir(os.path.join(cfg.output_dir, run_name), ranks.is_main)
    resume = None
    if cfg.checkpoint.resume not in ("auto", "never"):
        resume = cfg.checkpoint.resume
    elif os.path.isdir(rd.path) and os.listdir(rd.path):
        found = ckpt.latest(rd.checkpoints)
        summary = read_json(rd.file("summary.json")) if os.path.exists(rd.file("summary.json")) else {}
        if cfg.checkpoint.resume == "never" or found is None:
            raise ConfigError([f"run_name: {rd.path} already holds a run"
                               + (" with no complete checkpoint" if found is None else "")
                               + "; rule: a run directory is never overwritten; fix: choose another run_name"
                               + ("" if found is None else " or checkpoint.resume=auto to continue it")])
        step = ckpt.read_marker(found)["step"]
        if summary.get("status") == "completed" and step >= cfg.train.max_steps:
            raise ConfigError([f"run_name: {rd.path} already completed {step} steps; rule: a finished run is not "
                               f"overwritten; fix: another run_name, or train.max_steps > {step} to continue it"])
        resume = found
    ranks.barrier()  # every rank has looked before rank 0 creates anything
    rd.create()
    return rd, resume, run_name


def make_engine(cfg: Config, spec: RunSpec, hw: Hardware, hf_config, rd: RunDir, state: dict | None = None,
                loss_scale: float | None = None):
    """A model and engine for ``spec``. With ``state`` (portable_state of the engine it replaces), the weights
    go into the model before the engine wraps it, so low-precision copies are made from them; ``loss_scale``:
    the fp16 scale the replaced engine had reached (scales are powers of two), so the new one does not start
    again at 2**initial_power and skip steps finding it."""
    if loss_scale:
        cfg = replace(cfg, loss_scale=replace(cfg.loss_scale, initial_power=max(0, round(math.log2(loss_scale)))))
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, weight_dtype(cfg, spec.engine, spec.precision), hf_config, device=spec.device,
                        precision=spec.precision, checkpointing=spec.checkpointing)
    if state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in state:
                    p.copy_(state[name]["param"])
    engine, ds_config = engines.build(cfg, spec, model, hw, hf_config.hidden_size, lr_at(0, cfg.train))
    if ds_config is not None:
        rd.write_json("ds_config.json", ds_config)
    return engine, model


def memory_now(device: torch.device) -> dict:
    out = {"gpu_allocated_bytes": None, "gpu_reserved_bytes": None,
           "cpu_rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(engine, data, micro_batch: int, ranks: dist.Dist, max_batches: int = 16) -> float:
    """Mean eval loss. Every rank runs the same number of batches (ZeRO-3 and FSDP forwards are collective)."""
    n = len(data)
    batches = max(1, min(max_batches, n // (micro_batch * ranks.world)))
    losses = []
    for i in range(batches):
        start = ((i * ranks.world + ranks.rank) * micro_batch) % n
        losses.append(engine.eval_loss(data.batch([(start + j) % n for j in range(micro_batch)])))
    return ranks.mean(sum(losses) / max(1, len(losses)))
