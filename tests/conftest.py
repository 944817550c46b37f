"""Fixtures and markers only (the run helpers live in tests/helpers)."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """Tests never read or write the user's cache folder (a calibration there would change the plans the
    tests expect): XDG_CACHE_HOME points at a temporary folder, for this process and the CLI runs it starts."""
    import os

    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    # `vramfit plan` forks trace workers; a test process may hold threads of earlier tests (a fork copies none of
    # them, and a lock one held stays held), so plans run in-process here trace in-process. The workers have
    # their own test (tests/test_trace_cache.py).
    os.environ.setdefault("VRAMFIT_TRACE_WORKERS", "0")
    # the plan-time check of a calibration against this machine now (launcher.machine.recheck) depends on what else
    # runs beside the tests: off, but in its own tests
    os.environ.setdefault("VRAMFIT_RECHECK", "off")
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


EXTENDED_TIMEOUT_S = 1200  # pyproject.toml's per-test limit (300 s) is for what CI runs; the by-hand set gets this


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: an ``extended`` test is a slow one, whatever it says
def pytest_collection_modifyitems(config, items):
    """Tests marked ``extended`` are ``slow`` too (the default run never runs them; CI's slow set leaves them
    out), with a longer time limit; tests marked ``gpu`` skip themselves without CUDA (``pytest -m gpu`` selects
    them on a GPU host)."""
    for item in items:
        if item.get_closest_marker("extended"):
            if not item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.slow)
            if not item.get_closest_marker("timeout"):  # a first JIT build of async_io alone takes minutes
                item.add_marker(pytest.mark.timeout(EXTENDED_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def vramfit_log(caplog):
    """caplog that sees vramfit's records (its logger does not propagate to the root logger)."""
    logger = logging.getLogger("vramfit")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="vramfit")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def no_deepspeed_path(tmp_path):
    """A directory that, put first on PYTHONPATH, makes DeepSpeed unimportable as if it were not installed:
    its sitecustomize sets sys.modules['deepspeed'] = None, so `import deepspeed` raises ModuleNotFoundError
    and importlib.util.find_spec('deepspeed') (what transformers and accelerate ask) returns None."""
    d = tmp_path / "no_ds"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n")
    return str(d)


@pytest.fixture(scope="module")
def deepspeed_fp16_on_cpu():
    """Let DeepSpeed train its fp16 profiles on the CPU, for the tests of this module only: its CPU accelerator
    refuses fp16 (``is_fp16_supported()`` is False), and vramfit says so before a run (launcher.precision). Both
    checks are widened together, so the fp16 path runs as on a GPU: the loss scaler, overflow detection, skipped
    steps, checkpoints. Nothing of the product changes: a CPU computes fp16 no faster than fp32."""
    from helpers import has_deepspeed

    if not has_deepspeed():
        pytest.skip("DeepSpeed is not installed: its fp16 profiles are not checked")
    from deepspeed.accelerator import get_accelerator

    import launcher.precision

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
        mp.setattr(launcher.precision, "DEEPSPEED_FP16_DEVICES", ("cuda", "cpu"))
        yield
