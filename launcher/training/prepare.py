"""The start of a run: everything before the first step. Decide (probe, settle the config into a frozen RunSpec,
plan) before anything loads, load the data, claim the run directory and its resume point
(:mod:`launcher.training.resume`), build the model and engine, restore the checkpoint being continued.
Input problems surface before the run directory exists, and a refused resume changes nothing in it."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace

import torch

from launcher import engines, log
from launcher.config.schema import Config, ConfigError, to_dict, to_yaml, with_epochs
from launcher.data import load_splits
from launcher.log import logger
from launcher.machine import diskspace, dist, heap, speeds, threads
from launcher.machine.hardware import Hardware, enforce_gpu_budget, probe
from launcher.model import hfconfig, kernels, lora, preference
from launcher.model.build import build_model, count_params, load_tokenizer, model_config
from launcher.plan import decide, report
from launcher.plan.families import family_of
from launcher.plan.ladder import Rung
from launcher.plan.resolve import RunSpec
from launcher.training import checkpoint as ckpt
from launcher.training import generate, rankladder, resume
from launcher.training.faults import Hooks
from launcher.training.monitor import MemoryMonitor
from launcher.training.rundir import RunDir
from launcher.training.schedule import lr_at
from launcher.training.startup import Startup
from launcher.training.state import Run
from launcher.training.tracking import Trackers
from launcher.units import GiB


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
    gathers = spec.device.type == "cpu" and family_of(spec.profile).shards_params
    one_auto = ranks.world == 1 and cfg.memory.mmap_threshold_mib == "auto"  # several ranks: fixed above
    mib = heap.threshold_mib("auto", 1, share, gathers) if one_auto else 0.0
    if mib:
        # from here on (before the model is made) big blocks go back
        done = heap.fix_mmap_threshold(mib)
        why = (f"{spec.profile.name} gathers each layer's weights on the CPU at every step" if gathers
               else f"the planned host peak is {share:.0%} of the host budget")
        logger.info(f"heap: {done} ({why})")
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
    _claim_run_dir(run, cleanup)
    _build_engine(run)
    if run.resume_from:
        resume.restore(run)
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


def _claim_run_dir(run: Run, cleanup: contextlib.ExitStack) -> None:
    """The run directory claimed with its resume point (:func:`launcher.training.resume.prepare_run_dir`), the
    RunSpec the run goes on with (the checkpoint's rung; one rung down after an OOM on one of several ranks), and
    config.yaml and plan.json written."""
    cfg, ranks = run.cfg, run.ranks
    run.rd, run.resume_from, run.run_name, run.damaged = resume.prepare_run_dir(cfg, ranks, cleanup)
    if run.resume_from:
        run.spec = resume.resume_spec(run)
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


def _build_engine(run: Run) -> None:
    """The device readied (its memory cap, its peak counters), the memory monitor, then the model and engine
    (:func:`make_engine`), said in two lines."""
    cfg, spec = run.cfg, run.spec
    if run.device.type == "cuda":
        torch.cuda.set_device(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        capped = enforce_gpu_budget(cfg.memory.gpu_budget, run.device)
        if capped:
            logger.info(capped)
    run.mon = MemoryMonitor.for_run(cfg, run.rd, run.device)  # stopped at the end of fit
    if not run.resume_from:
        run.mon.start()  # memory.csv from here (a resume appends to it once its checkpoint has loaded)
    run.startup.lap("run directory")
    run.objective = preference.objective_for(cfg)
    run.engine, run.model = make_engine(cfg, spec, run.hw, run.hf_config, run.rd, startup=run.startup,
                                        objective=run.objective)
    if run.device.type == "cuda":  # engine set-up can briefly hold two copies of the weights; training is apart
        run.init_peak_gpu = torch.cuda.max_memory_allocated(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
    n_total, n_train = count_params(run.model)
    logger.info(f"model {cfg.model.name}: {n_total / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable); "
                f"data: {len(run.train_data)} samples of up to {cfg.data.seq_len} tokens, {run.train_data.description}")
    logger.info(f"engine {run.engine.name}, profile {spec.profile.name}, optimizer {run.engine.optimizer_name}, "
                f"micro-batch {spec.micro_batch} x accumulation {spec.accumulation} x {run.ranks.world} rank(s) = "
                f"{cfg.train.global_batch_size}")


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
