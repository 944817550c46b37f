"""The end of a run: the final eval and final/ (from the best checkpoint after an early stop), summary.json,
memory.png and the sample after training; and the diagnosis of a run that a full disk stopped."""

from __future__ import annotations

import os

from launcher.log import logger
from launcher.machine.files import DiskFull, disk_full_message
from launcher.training import checkpoint as ckpt
from launcher.training import evaluation, generate, plots, progress
from launcher.training.evaluation import perplexity
from launcher.training.rundir import RunDir
from launcher.training.state import Run


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
        eval_loss = st.best_eval_loss if best else evaluation.evaluate(run.engine, run.eval_data, run.spec.micro_batch,
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
        "peak_rss_by_phase_per_rank": run.ranks.gather(mon.host_peaks()) if run.ranks.world > 1 and run.finished
        else None,
    }


def disk_advice(e: OSError, rd: RunDir, last_ckpt: str | None) -> str:
    """The diagnosis of a run that a full disk stopped: what did not fit, and how to go on."""
    what = str(e) if isinstance(e, DiskFull) else disk_full_message(f"a write ({e})", rd.path)
    if last_ckpt:
        return (f"{what}; the last good checkpoint is {last_ckpt}; fix: free space on that disk (or lower "
                "checkpoint.keep_last), then run the same command again to resume from it")
    return (f"{what}; no checkpoint was written yet; fix: free space on that disk, or choose an output_dir on "
            "another, and start again with a new run_name")
