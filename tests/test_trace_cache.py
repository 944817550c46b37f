"""The meta trace's op-result cache and its storage bookkeeping: a trace is the same with the cache off, filling
and hit, and the same every time (no dependence on which addresses the allocator hands out)."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

import launcher.plan.memory.estimate as E
import launcher.plan.memory.trace as T
from launcher.plan.memory import tracker

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=3, vocab_size=256)
BASE = T.TraceSettings(batch_size=2, seq_len=32)
VARIANTS = {
    "plain": {},
    "lora-autocast-flash": dict(param_dtype=torch.bfloat16, adapter_dtype=torch.float32,
                                autocast_dtype=torch.bfloat16, lora_r=8, attention_kernel="flash"),
    "every-2nd-efficient": dict(gradient_checkpointing=True, checkpoint_every=2, param_dtype=torch.bfloat16,
                                attention_kernel="efficient"),
    "ckpt-offload-chunked": dict(gradient_checkpointing=True, offload_activations=True, chunked_loss=True,
                                 autocast_dtype=torch.bfloat16),
    "offload-packed-dropout": dict(offload_activations=True, packed=True, lora_r=4, lora_dropout=0.1),
    "ckpt-lora-autocast-cpu": dict(gradient_checkpointing=True, lora_r=4, autocast_dtype=torch.bfloat16, target="cpu"),
}


def _trace(s: T.TraceSettings, cache: bool, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        if not cache:
            m.setattr(tracker, "_functional", lambda func: False)
            m.setattr(tracker, "_FUNCTIONAL", {})
        d = T.trace_depth(CFG, 2, s).to_dict()
    d.pop("seconds")
    return d


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_op_cache_changes_nothing(name, monkeypatch):
    s = dataclasses.replace(BASE, **VARIANTS[name])
    monkeypatch.setattr(tracker, "_META_RESULTS", {})
    monkeypatch.setattr(tracker, "_FUNCTIONAL", {})
    plain = _trace(s, False, monkeypatch)
    filling = _trace(s, True, monkeypatch)
    assert tracker._META_RESULTS, "nothing was cached"
    hit = _trace(s, True, monkeypatch)
    assert plain == filling == hit


def test_saved_bytes_do_not_depend_on_the_allocator(monkeypatch):
    """With activation offload every saved tensor dies in the forward (its CPU copy stays), so later
    storages reuse its address; each is still counted once."""
    s = dataclasses.replace(BASE, **VARIANTS["offload-packed-dropout"])
    runs = [_trace(s, False, monkeypatch)["saved"] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    plain = _trace(dataclasses.replace(s, offload_activations=False), False, monkeypatch)["saved"]
    assert runs[0] == plain  # offloading moves what is saved, not what is saved


def test_traces_made_in_worker_processes_equal_those_made_here(monkeypatch):
    """``vramfit plan`` traces in forked workers (estimate.parallel): the estimate is the same, the pool ran, and the
    traces came back into this process's cache."""
    import sys

    if sys.platform != "linux":
        pytest.skip("worker processes are forked on Linux only")
    cfg = LlamaConfig(**{**CFG.to_dict(), "num_hidden_layers": 6})
    s = dataclasses.replace(BASE, batch_size=8, gradient_checkpointing=True, checkpoint_every=2,
                            chunked_loss=True, lora_r=4)
    monkeypatch.setattr(E, "_STORE", None)

    def estimate():
        monkeypatch.setattr(E, "_TRACES", {})
        monkeypatch.setattr(E, "_ESTIMATES", {})
        d = E.estimate_activations(cfg, s, exact=False).to_dict()
        d.pop("trace_seconds")
        return d

    here = estimate()  # also leaves op results behind, which the workers start with
    with E.parallel(2):
        there = estimate()
        assert E._POOL is not None
        assert len(E._TRACES) >= 4
    assert E._POOL is None and E._WORKERS == 0
    assert there == here


def test_a_bad_worker_count_is_refused(monkeypatch):
    from launcher.config.schema import ConfigError
    from launcher.plan import tracestore

    monkeypatch.setenv("VRAMFIT_TRACE_WORKERS", "two")
    with pytest.raises(ConfigError, match="VRAMFIT_TRACE_WORKERS: got 'two'"):
        tracestore.workers()
    monkeypatch.setenv("VRAMFIT_TRACE_WORKERS", "0")
    assert tracestore.workers() == 0
    monkeypatch.delenv("VRAMFIT_TRACE_WORKERS")
    assert 1 <= tracestore.workers() <= 4
