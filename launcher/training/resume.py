"""Where a run starts from: the run directory it claims (locked, never overwritten), the checkpoint it continues
and the RunSpec that goes on with it, and that checkpoint loaded into the engine and the loop's state."""

from __future__ import annotations

import contextlib
import os

from launcher.config.profiles import PROFILES
from launcher.config.schema import Config, ConfigError
from launcher.log import logger
from launcher.machine import dist
from launcher.machine.files import read_json
from launcher.plan.ladder import Rung
from launcher.plan.resolve import RunSpec
from launcher.training import checkpoint as ckpt
from launcher.training import rankladder
from launcher.training.rundir import LOCK, LockHeld, RunDir, RunLock, default_run_name, failed_start, set_aside_failed_start
from launcher.training.state import Run, State


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

def resume_spec(run: Run) -> RunSpec:
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



def restore(run: Run) -> None:
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

