"""The training loop. One loop for every engine; it reads top to bottom in :func:`train`.

setup (probe, resolve, plan, run directory) -> model and data -> engine -> resume -> for each step:
micro-batches (forward + backward), step (clip, unscale, update), log, eval, checkpoint -> final
weights, summary.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field, replace

import psutil
import torch

from launcher import checkpoint as ckpt
from launcher import generate, lora
from launcher.config import Config, ConfigError, to_yaml
from launcher.data import load_data, micro_batches
from launcher.engines.base import StepResult
from launcher.hardware import Hardware, pin_memory_ok, probe
from launcher.ladder import Rung, next_move
from launcher.models import (build_model, count_params, enable_checkpointing, load_tokenizer, model_config, param_groups,
                             weight_dtype)
from launcher.monitor import MemoryMonitor
from launcher.profiles import PROFILES
from launcher.progress import Progress
from launcher.resolve import Resolved, candidate_order, resolve
from launcher.rundir import RunDir, default_run_name, read_json

EXIT_INTERRUPTED = 130  # documented in the README: the run saved a checkpoint and can be resumed
EXIT_FAILED = 1


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[vramfit] {msg}", flush=True)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to ``train.lr``, then cosine down to ``lr x min_lr_ratio`` at ``max_steps``."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def any(self, flag: bool) -> bool:
        if self.world > 1 and torch.distributed.is_initialized():
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())
        return flag

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a one-item list on one rank)."""
        if self.world > 1 and torch.distributed.is_initialized():
            out = [None] * self.world
            torch.distributed.all_gather_object(out, obj)
            return out
        return [obj]

    def mean(self, x: float) -> float:
        if self.world > 1 and torch.distributed.is_initialized():
            t = torch.tensor([x], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            return float(t) / self.world
        return x


def dist_env() -> Dist:
    return Dist(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                int(os.environ.get("LOCAL_RANK", "0")))


@dataclass
class Hooks:
    """Test-only fault injection (never a user option): called with the step number."""
    before_step: object | None = None  # fn(step, engine): may raise (a fake OOM)
    after_backward: object | None = None  # fn(step, engine): may poison gradients (inf/nan injection)
    after_step: object | None = None  # fn(step): e.g. send SIGTERM
    during_save: object | None = None  # fn(path): e.g. SIGKILL while a checkpoint is written


@dataclass
class State:
    step: int = 0
    first_loss: float | None = None
    skipped: int = 0
    fallbacks: list = field(default_factory=list)
    resumed_from: str | None = None
    tokens_seen: int = 0


class StopRequested:
    """SIGTERM/SIGINT: finish the optimizer step, checkpoint, exit. A second signal exits at once."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.signum is not None:
            os._exit(EXIT_INTERRUPTED)
        self.signum = signum
        log(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (send again to exit at once)")

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)

    def __bool__(self):
        return self.signum is not None


def memory_now(device: torch.device) -> dict:
    out = {"gpu_allocated_bytes": None, "gpu_reserved_bytes": None,
           "cpu_rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return out


def prepare_run_dir(cfg: Config, dist: Dist) -> tuple[RunDir, str | None]:
    """The run directory, and the checkpoint to resume from (None = fresh start). Nothing is overwritten."""
    if not cfg.run_name:
        name = default_run_name(cfg.model.name)
        if dist.world > 1:  # all ranks must agree on the timestamped name
            obj = [name]
            torch.distributed.broadcast_object_list(obj, src=0)
            name = obj[0]
        cfg.run_name = name
    rd = RunDir(os.path.join(cfg.output_dir, cfg.run_name), dist.is_main)
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
    dist.barrier()  # every rank has looked before rank 0 creates anything
    rd.create()
    return rd, resume


def build_engine(cfg: Config, res: Resolved, model, hw: Hardware, hidden_size: int):
    groups = param_groups(model, cfg.train.weight_decay)
    t = cfg.train
    betas = (t.beta1, t.beta2)
    if res.engine == "deepspeed":
        from launcher.engines.deepspeed import DeepSpeedEngine
        from launcher.profiles import resolve_ds_config

        n_train = sum(p.numel() for g in groups for p in g["params"])
        pin, why = pin_memory_ok(hw, 16 * n_train) if res.profile.offloads else (False, "")
        if res.profile.offloads:
            log(f"pin_memory {'on' if pin else 'off'}: {why}")
        if res.user_ds is not None:  # deepspeed_config: the user's JSON, its "auto" filled like a profile's
            from launcher import user_ds_config

            ds_config = user_ds_config.resolve(res.user_ds, user_ds_config.run_values(
                cfg, res.precision, res.micro_batch, res.accumulation, res.world, hidden_size, pin, lr_at(0, cfg)))
            zero = ds_config.get("zero_optimization", {})
            for k in ("offload_optimizer", "offload_param"):
                asked = res.user_ds.template.get("zero_optimization", {}).get(k, {}).get("pin_memory")
                if isinstance(asked, bool) and asked != pin and isinstance(zero.get(k), dict):
                    log(f"{k}.pin_memory {str(asked).lower()} as deepspeed_config asks (vramfit would choose "
                        f"{'on' if pin else 'off'}: {why})")
        else:
            ds_config = resolve_ds_config(res.profile, micro_batch=res.micro_batch, accumulation=res.accumulation,
                                          world=res.world, grad_clip=t.grad_clip, lr=lr_at(0, cfg), betas=betas,
                                          eps=t.eps, weight_decay=t.weight_decay, hidden_size=hidden_size,
                                          pin_memory=pin, loss_scale=vars(cfg.loss_scale))
        return DeepSpeedEngine(model, ds_config=ds_config, param_groups=groups, device=res.device), ds_config
    if res.engine == "fsdp":
        from launcher.engines.fsdp import FsdpEngine

        n_train = sum(p.numel() for g in groups for p in g["params"])
        pin, why = pin_memory_ok(hw, 8 * n_train)  # the fp32 weight and gradient shards FSDP keeps on the CPU
        log(f"pin_memory {'on' if pin else 'off'}: {why}")
        return FsdpEngine(model, precision=res.precision, device=res.device, lr=lr_at(0, cfg), betas=betas,
                          eps=t.eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                          loss_scale=cfg.loss_scale, pin_memory=pin), None
    from launcher.engines.amp import AmpEngine

    return AmpEngine(model, precision=res.precision, device=res.device, param_groups=groups, lr=lr_at(0, cfg),
                     betas=betas, eps=t.eps, grad_clip=t.grad_clip, loss_scale=cfg.loss_scale,
                     optimizer=t.optimizer), None


def train(cfg: Config, hooks: Hooks | None = None, hw: Hardware | None = None) -> dict:
    """Run one training job end to end. Returns the summary (also written to summary.json)."""
    try:
        return _train(cfg, hooks, hw)
    finally:
        from launcher.engines.deepspeed import restore_torch_functions  # does not import deepspeed

        restore_torch_functions()


def _train(cfg: Config, hooks: Hooks | None, hw: Hardware | None) -> dict:
    hooks = hooks or Hooks()
    dist = dist_env()
    if dist.world > 1 and not torch.distributed.is_initialized():
        # nccl for the model's tensors on CUDA, gloo for the loop's small CPU reductions (loss, stop flag)
        backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
        torch.distributed.init_process_group(backend)
    hw = hw or probe()
    # ---- resolve everything before loading anything
    hf_config = model_config(cfg)
    lora.check(cfg, hf_config)  # bitsandbytes present when needed; LoRA target names exist (on a meta model)
    res = resolve(cfg, hw, dist.world)
    for r in res.reasons:
        log(r)
    seq_len = cfg.data.seq_len
    max_pos = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if max_pos and seq_len > max_pos:
        raise ConfigError([f"data.seq_len: got {seq_len}; rule: at most the model's maximum of {max_pos} positions; "
                           f"fix: data.seq_len={max_pos}"])
    # ---- tokenizer, data, sample prompt: input problems surface before the run directory exists
    tokenizer = load_tokenizer(cfg)
    data = load_data(cfg, hf_config.vocab_size, tokenizer)
    train_data, eval_data = data.split(cfg.data.eval_fraction, cfg.seed)
    sample_prompt = generate.prompt_ids(cfg, tokenizer, eval_data if eval_data is not None else train_data)
    rd, resume_from = prepare_run_dir(cfg, dist)
    settings = ckpt.fixed_settings(cfg)
    rung = Rung(res.micro_batch, res.accumulation, cfg.model.gradient_checkpointing, res.profile.name)
    if resume_from:
        marker = ckpt.read_marker(resume_from)
        diff = ckpt.diff_settings(marker["settings"], settings)
        if diff:
            raise ConfigError([f"checkpoint {resume_from}: settings changed since it was written; rule: these must "
                               f"match to resume; fix: restore them or choose another run_name. Changes: {'; '.join(diff)}"])
        if marker.get("rung"):  # continue where the OOM ladder had got to
            rung = Rung(**marker["rung"])
        custom = rung.profile not in PROFILES  # written by a deepspeed_config run (its custom row)
        if (custom or res.user_ds is not None) and rung.profile != res.profile.name:
            raise ConfigError([f"checkpoint {resume_from}: written by profile {rung.profile}, this run is "
                               f"{res.profile.name}; rule: a run with its own deepspeed_config resumes with the same "
                               "JSON layout, and a catalogue run without one; fix: the deepspeed_config the run "
                               "started with (or none), or another run_name"])
    cfg.model.gradient_checkpointing = rung.checkpointing
    rd.write_text("config.yaml", to_yaml(cfg))
    if res.plan is not None:
        rd.write_json("plan.json", res.plan.to_json())
    device = res.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        enforce_gpu_budget(cfg, device)
    mon = MemoryMonitor.for_run(cfg, rd, device, log).start()  # memory.csv from here; stopped in the loop's finally
    # ---- model, engine

    def make_engine(rung: Rung, state: dict | None = None, loss_scale: float | None = None):
        """A model and engine for ``rung``; with ``state`` (portable_state of the engine it replaces), the
        weights go into the model before the engine wraps it, so low-precision copies are made from them;
        ``loss_scale``: the fp16 scale the replaced engine had reached (scales are powers of two), so the new
        one does not start again at 2**initial_power and skip steps finding it."""
        profile = res.profile if rung.profile == res.profile.name else PROFILES[rung.profile]  # custom: not in PROFILES
        c = cfg
        if loss_scale:
            c = replace(cfg, loss_scale=replace(cfg.loss_scale, initial_power=max(0, round(math.log2(loss_scale)))))
        r = replace(res, profile=profile, precision=profile.precision, micro_batch=rung.micro_batch,
                    accumulation=rung.accumulation)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, weight_dtype(cfg, profile.engine, profile.precision), hf_config, device=res.device,
                            precision=profile.precision)
        if state is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in state:
                        p.copy_(state[name]["param"])
        if rung.checkpointing:
            enable_checkpointing(model)
        engine, ds_config = build_engine(c, r, model, hw, hf_config.hidden_size)
        if ds_config is not None:
            rd.write_json("ds_config.json", ds_config)
        return engine, model

    engine, model = make_engine(rung)
    init_peak_gpu = None
    if device.type == "cuda":  # engine set-up can briefly hold two copies of the weights; training is measured apart
        init_peak_gpu = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    n_total, n_train = count_params(model)
    log(f"model {cfg.model.name}: {n_total / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable); "
        f"data: {len(train_data)} samples of {seq_len} tokens, {data.description}")
    log(f"engine {engine.name}, profile {rung.profile}, optimizer {engine.optimizer_name}, micro-batch "
        f"{rung.micro_batch} x accumulation {rung.accumulation} x {dist.world} rank(s) = {cfg.train.global_batch_size}")
    # ---- resume
    st = State()
    if resume_from:
        client = engine.load(resume_from)
        st.step, st.first_loss, st.skipped = client["step"], client.get("first_loss"), client.get("skipped", 0)
        st.fallbacks, st.tokens_seen = client.get("fallbacks", []), client.get("tokens_seen", 0)
        rng = client["rng"]
        ckpt.set_rng_state(rng[min(dist.rank, len(rng) - 1)] if isinstance(rng, list) else rng)
        st.resumed_from = resume_from
        rd.truncate_metrics(st.step)
        log(f"resumed from {resume_from} at step {st.step}")

    def client_state() -> dict:
        return {"step": st.step, "samples_seen": st.step * cfg.train.global_batch_size, "first_loss": st.first_loss,
                "skipped": st.skipped, "fallbacks": st.fallbacks, "tokens_seen": st.tokens_seen,
                "rng": dist.gather(ckpt.rng_state())}

    def save_checkpoint() -> str:
        path = ckpt.save(engine, rd.checkpoints, st.step, client_state(), settings, is_main=dist.is_main,
                         barrier=dist.barrier, keep_last=cfg.checkpoint.keep_last, extra={"rung": asdict(rung)},
                         during_save=hooks.during_save)
        log(f"checkpoint {path}")
        return path

    # ---- the loop
    stop = StopRequested().install()
    status, diagnosis = "completed", None
    t_start = time.perf_counter()
    tokens_per_step = cfg.train.global_batch_size * seq_len
    peak_rss = psutil.Process().memory_info().rss
    loss, at_min_scale, last_scale = float("nan"), 0, None  # last_scale: fp16 loss scale after the last step
    # A deepspeed_config run never moves to a catalogue profile (that would drop the user's settings): its OOM
    # ladder halves the micro-batch and turns on checkpointing, then stops.
    usable = [] if res.user_ds is not None else candidate_order(cfg, hw, res.precision, device, allow_offload=True)[0]
    progress = Progress(cfg, st.step, log, _format_row)
    try:
        while st.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(st.step, cfg)
            move = None
            try:
                if hooks.before_step:
                    hooks.before_step(st.step, engine)
                mon.mark("forward", engine)  # model hooks split forward from backward
                losses = [engine.forward_backward(train_data.batch(rows), rung.accumulation)
                          for rows in micro_batches(st.step, cfg.train.global_batch_size, rung.micro_batch,
                                                    dist.rank, dist.world, len(train_data), cfg.seed)]
                loss = dist.mean(float(torch.stack(losses).mean()))
                if hooks.after_backward:
                    hooks.after_backward(st.step, engine)
                if not math.isfinite(loss) and res.precision != "fp16":
                    status, diagnosis = "failed", diagnose(engine, train_data, rung, st, cfg, lr,
                                                           f"loss became {loss} at step {st.step + 1}")
                    engine.reset_micro_batch(rung.micro_batch, rung.accumulation)  # never apply that update
                    break
                mon.mark("step")
                result: StepResult = engine.step(lr)
                last_scale = result.loss_scale
            except torch.OutOfMemoryError:  # anything else propagates untouched
                # One process only: with several ranks the others wait in a collective of this step and
                # cannot take part in a move (portable_state and a new engine are collectives too).
                move = next_move(rung, usable) if cfg.train.oom_fallback and dist.world == 1 else None
                if move is None:
                    if dist.world > 1 and cfg.train.oom_fallback:
                        log(f"OOM at step {st.step + 1} on rank {dist.rank}: the OOM ladder runs in single-process "
                            "runs only; resume from the last checkpoint with a smaller train.micro_batch_size")
                    raise
            if move is not None:
                # Out of the except block: until it ends, the exception's traceback keeps the failed step's
                # frames, and with them its activations and the engine, from being freed.
                log(f"OOM at step {st.step + 1}: {move.reason}")
                st.fallbacks.append({"from": asdict(rung), "to": asdict(move.to), "reason": move.reason,
                                     "step": st.step + 1})
                if move.kind == "profile" or not engine.resets_in_place:  # rebuild from the last state
                    state = engine.portable_state()
                    engine.close()  # DeepSpeed keeps references (hooks) that would outlive the object
                    mon.unwatch()
                    engine = model = None
                    free_memory(device)
                    engine, model = make_engine(move.to, state, last_scale)
                    engine.load_portable_state(state, st.step - st.skipped)
                    del state
                else:
                    engine.reset_micro_batch(move.to.micro_batch, move.to.accumulation)
                    if move.kind == "checkpointing":
                        enable_checkpointing(engine.module())
                    free_memory(device)
                rung = move.to
                cfg.model.gradient_checkpointing = rung.checkpointing
                continue
            st.step += 1
            st.tokens_seen += tokens_per_step
            st.skipped += int(result.skipped)
            if st.first_loss is None:
                st.first_loss = loss
            dt = time.perf_counter() - t0
            mem = memory_now(device)
            peak_rss = max(peak_rss, mem["cpu_rss_bytes"])
            row = {"step": st.step, "loss": loss, "lr": lr, "loss_scale": result.loss_scale,
                   "skipped": result.skipped, "grad_norm": result.grad_norm, "tokens": st.tokens_seen,
                   "tokens_per_s": tokens_per_step / dt, **mem, "time_s": time.perf_counter() - t_start,
                   "micro_batch": rung.micro_batch, **mon.end_step(st.step, mem)}
            rd.append_metrics(row)
            progress.update(row)  # a bar on a terminal, else a log line every log.every_steps
            # fp16 that keeps overflowing at the minimum scale will never train: stop with a diagnosis
            at_min = result.skipped and result.loss_scale is not None and result.loss_scale <= cfg.loss_scale.min_scale
            at_min_scale = at_min_scale + 1 if at_min else 0
            if at_min_scale >= cfg.loss_scale.patience:
                status, diagnosis = "failed", diagnose(
                    engine, train_data, rung, st, cfg, lr,
                    f"{at_min_scale} steps in a row overflowed at the minimum loss scale {cfg.loss_scale.min_scale:g}")
                break
            if eval_data is not None and cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                log(f"eval loss {evaluate(engine, eval_data, rung.micro_batch, dist):.4f} at step {st.step}")
            if hooks.after_step:
                hooks.after_step(st.step)
            if dist.any(bool(stop)):  # ranks agree, so all of them save the same step
                status = "interrupted"
                break
            if (cfg.checkpoint.save and cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0
                    and st.step < cfg.train.max_steps):
                save_checkpoint()
        last_ckpt = save_checkpoint() if cfg.checkpoint.save else None
    finally:
        stop.restore()
        rd.close()
        progress.close()
        mon.stop()
    elapsed = time.perf_counter() - t_start
    # ---- outputs
    eval_loss = evaluate(engine, eval_data, rung.micro_batch, dist) if eval_data is not None else None
    sample = None
    if status == "completed":
        if cfg.checkpoint.save:
            engine.save_final(rd.file("final"))
            if tokenizer is not None and dist.is_main:
                tokenizer.save_pretrained(rd.file("final"))
        sample = generate.run_sample(engine, sample_prompt, cfg, tokenizer, res.precision, rd.path, dist.is_main, log)
    if diagnosis:
        log(f"stopped: {diagnosis}")
    measured = [m["tokens_per_s"] for m in rd.metrics()[1:]] if dist.is_main else []
    summary = {
        "status": status, "engine": engine.name, "profile": rung.profile, "precision": res.precision,
        "device": str(device), "steps": st.step, "first_loss": st.first_loss, "final_loss": loss,
        "eval_loss": eval_loss,
        "tokens_per_s": (sum(measured) / len(measured)) if measured else tokens_per_step * st.step / max(elapsed, 1e-9),
        "peak_gpu_bytes": mon.peak_gpu_bytes(), "peak_gpu_reserved_bytes": mon.peak_gpu_reserved_bytes(),
        "peak_cpu_rss_bytes": peak_rss,
        "peak_gpu_init_bytes": init_peak_gpu,
        "predicted_gpu_bytes": _pick(res.plan, "gpu_bytes"), "predicted_cpu_bytes": _pick(res.plan, "cpu_bytes"),
        "predicted_gpu_tensor_bytes": _pick(res.plan, "gpu_tensor_bytes"),
        "skipped_steps": st.skipped, "fallbacks": st.fallbacks, "resumed_from": st.resumed_from,
        "optimizer": engine.optimizer_name, "micro_batch": rung.micro_batch, "accumulation": rung.accumulation,
        "gradient_checkpointing": rung.checkpointing, "world_size": dist.world,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": seq_len, "elapsed_s": elapsed,
        "checkpoint": last_ckpt, "reasons": res.reasons, "diagnosis": diagnosis, "run_dir": rd.path,
        "sample": sample, **mon.summary(),
    }
    rd.write_json("summary.json", summary)
    mon.plot(rd.file("memory.png"), summary["predicted_gpu_bytes"], summary["predicted_cpu_bytes"], rd.path)
    _print_summary(summary)
    engine.close()  # a DeepSpeed engine would otherwise stay in memory after the run (in-process callers)
    return summary


def enforce_gpu_budget(cfg: Config, device: torch.device) -> None:
    """``memory.gpu_budget=GiB`` on a bigger card: cap this process's allocator, so that a 16 GB card can be
    reproduced on any larger one (allocations past the cap raise OutOfMemoryError like a full card)."""
    if cfg.memory.gpu_budget == "auto":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    budget = float(cfg.memory.gpu_budget) * 2**30
    if budget < total:
        torch.cuda.set_per_process_memory_fraction(budget / total, device)
        log(f"GPU budget {cfg.memory.gpu_budget} GiB enforced: {budget / total:.1%} of {total / 2**30:.1f} GiB")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def diagnose(engine, data, rung: Rung, st: State, cfg: Config, lr: float, what: str) -> str:
    """Why the numbers went non-finite: which parameters' gradients and which modules' outputs."""
    parts = [what, f"lr {lr:.3g}"]
    bad_grads = getattr(engine, "nonfinite", None)
    if bad_grads:
        parts.append(f"inf/nan gradients in {len(bad_grads)} tensors, first: {', '.join(bad_grads[:4])}")
    rows = micro_batches(max(st.step - 1, 0), cfg.train.global_batch_size, rung.micro_batch, 0, 1, len(data), cfg.seed)[0]
    found = nonfinite_outputs(engine, data.batch(rows))
    if found:
        parts.append(f"first modules with inf/nan or fp16-overflowing outputs: {', '.join(found[:4])}")
    tips = ["a lower train.lr", "train.grad_clip=1.0" if not cfg.train.grad_clip else "a longer train.warmup_steps"]
    if engine.name and getattr(engine, "precision", None) == "fp16" or "fp16" in rung.profile:
        tips.insert(0, "precision=bf16 where the card has it (compute capability >= 8.0), or precision=fp32")
    parts.append("try: " + "; ".join(tips))
    return "; ".join(parts)


def nonfinite_outputs(engine, batch: dict, limit: float = 65504.0) -> list[str]:
    """Run one forward with hooks; name modules whose output is non-finite or beyond fp16's range."""
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(_mod, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
            if torch.is_tensor(t) and t.is_floating_point() and t.numel():
                if not torch.isfinite(t).all() or t.detach().abs().max() > limit:
                    found.append(name)
        return fn

    for name, mod in engine.module().named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        engine.eval_loss(batch)
    except Exception as e:  # a diagnosis must not hide the run's real state
        found.append(f"(diagnostic forward failed: {type(e).__name__})")
    finally:
        for h in handles:
            h.remove()
    return found


def _pick(plan, key):
    if plan is None:
        return None
    for p in plan.profiles:
        if p.profile == plan.chosen:
            return getattr(p, key)
    return None


@torch.no_grad()
def evaluate(engine, data, micro_batch: int, dist: Dist, max_batches: int = 16) -> float:
    """Mean eval loss. Every rank runs the same number of batches (ZeRO-3 and FSDP forwards are collective)."""
    n = len(data)
    batches = max(1, min(max_batches, n // (micro_batch * dist.world)))
    losses = []
    for i in range(batches):
        start = ((i * dist.world + dist.rank) * micro_batch) % n
        losses.append(engine.eval_loss(data.batch([(start + j) % n for j in range(micro_batch)])))
    return dist.mean(sum(losses) / max(1, len(losses)))


def _fmt_bytes(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}G"


def _format_row(r: dict, max_steps: int) -> str:
    scale = "-" if r["loss_scale"] is None else f"{r['loss_scale']:.0f}"
    norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.2f}"
    return (f"step {r['step']}/{max_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | scale {scale}"
            f"{' (skipped)' if r['skipped'] else ''} | grad norm {norm} | {r['tokens_per_s']:.0f} tok/s | "
            f"gpu {_fmt_bytes(r['gpu_allocated_bytes'])} | rss {_fmt_bytes(r['cpu_rss_bytes'])}")


def _print_summary(s: dict) -> None:
    def f(x, fmt="{:.4f}"):
        return "-" if x is None else fmt.format(x)

    log(f"{s['status']}: {s['steps']} steps on {s['device']} with {s['profile']} ({s['engine']}, {s['optimizer']})")
    log(f"loss {f(s['first_loss'])} -> {f(s['final_loss'])}"
        + (f" (eval {f(s['eval_loss'])})" if s.get("eval_loss") is not None else "")
        + f"; {s['tokens_per_s']:.0f} tokens/s; skipped steps {s['skipped_steps']}")
    log(f"peak memory: GPU {_fmt_bytes(s['peak_gpu_bytes'])} (planned {_fmt_bytes(s['predicted_gpu_bytes'])}), "
        f"CPU RSS {_fmt_bytes(s['peak_cpu_rss_bytes'])} (planned {_fmt_bytes(s['predicted_cpu_bytes'])})")
    if s.get("diagnosis"):
        log(f"diagnosis: {s['diagnosis']}")
    log(f"run directory: {s['run_dir']}")
