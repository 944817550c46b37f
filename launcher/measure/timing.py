"""How vramfit times things on this machine: the sizes a calibration measures (:class:`Sizes`), the fastest of
repeated calls at a thread count, the tiny Llamas whose fixed costs are measured, and whether a DeepSpeed op
loads without compiling. Shared by the calibration's parts (:mod:`launcher.measure.calibrate` for the device's
rates, copies, optimizers and disk, :mod:`launcher.measure.engine_costs` for the engines)."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

from launcher.machine.deepspeed_ops import op_state, use_env_ninja
from launcher.machine.timer import once, repeat

MiB = 1 << 20
FAMILIES = ("amp", "amp_offload", "zero2", "zero2_offload", "zero3_offload", "fsdp")  # launcher.plan.families names measured here
# Measured again at another precision on a CPU, kept as 'family@precision': DeepSpeed's bf16 path (16-bit
# weights, its fp32 partitions and the copy back) costs another engine time than its fp32 one (tiny Llama,
# batch 8: zero2-bf16 ran 140 ms a step where zero2-fp32's numbers priced it at 84).
CPU_EXTRA = ("zero2@bf16",)
# The tiny Llama of the per-op and engine measurements: everything but the fixed costs is negligible.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
TINY_SEQ = 8
LR = 1e-4


@dataclass(frozen=True)
class Sizes:
    """What is measured and how big; :meth:`quick` is for tests and a first look (seconds, not accurate)."""

    matmul: tuple = (64, 128, 256, 512, 1024, 2048)  # m = n = k on the CPU
    matmul_gpu: tuple = (256, 512, 1024, 2048, 4096, 8192)
    max_call_s: float = 0.5  # a matmul or attention call predicted slower than this is not run
    min_time_s: float = 0.1  # each timing repeats for at least this long
    attention: tuple = (1, 8, 512, 64)  # batch, heads, sequence, head dim
    attention_gpu: tuple = (4, 16, 2048, 128)
    memory_bytes: int = 64 * MiB  # per tensor of the elementwise op (far above a CPU's caches)
    memory_bytes_gpu: int = 256 * MiB
    copy_bytes: int = 256 * MiB
    view_chain: int = 64  # views in the chain that prices a view op
    step_depths: tuple = (1, 3)  # tiny models that price a kernel op
    # One tensor: the per-parameter cost. 16M parameters hold 256 MiB of state (parameter, gradient, two moments),
    # far above the caches; at 4M a 2-core EPYC stepped at 31 GB/s, above its 23 GB/s of memory bandwidth.
    optimizer_params: int = 16 * MiB
    optimizer_params_gpu: int = 64 * MiB
    optimizer_tensors: tuple = (512, 1024)  # how many, and elements each: the per-tensor cost
    optimizer_steps: int = 3  # warm-up steps before timing (the first allocates the moments)
    engine_depths: tuple = (1, 4)  # decoder layers: 12 and 39 parameter tensors
    # (layers, hidden) of a wider model, 44x the parameters of the deeper one for about half its tensors: the
    # engines' cost per parameter (their passes over weights and gradients: casts, copies to fp32 partitions,
    # shards). Wide enough that a flat fp32 buffer of it (41 MB) is above glibc's largest mmap threshold (32 MiB),
    # as a real model's are: such a buffer, made again every step (ZeRO-2's gradient partition, its flattened
    # copies), comes from fresh pages, each first touch a page fault (llama-125m on zero2-fp32: 8.2M minor faults in
    # an 8-step run, amp-fp32 1.7M), which a model 256 wide (1.7M parameters, its buffers reused from the heap)
    # never pays: its fits put ZeRO-2's cost per parameter at 0-1.4 ns a micro-batch where llama-125m pays several.
    engine_wide: tuple | None = (2, 640)
    engine_steps: int = 3  # timed optimizer steps per model and round, after one warm-up
    engine_rounds: int = 2  # every family's models timed once per round (see engine_costs.measure)
    families: tuple = FAMILIES
    deepspeed: bool = True  # its optimizers and engines (importing it and loading its ops: seconds)
    disk_bytes: int = 128 * MiB
    in_step: bool = True  # a CPU's rates measured inside training steps (launcher.measure.stepcal)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(matmul=(32, 64, 128), matmul_gpu=(256, 512), min_time_s=0.01, attention=(1, 2, 64, 16),
                   attention_gpu=(1, 4, 256, 64), memory_bytes=4 * MiB, memory_bytes_gpu=16 * MiB, copy_bytes=4 * MiB,
                   view_chain=16, step_depths=(1, 2), optimizer_params=256 * 1024, optimizer_params_gpu=1 * MiB,
                   optimizer_tensors=(32, 256), optimizer_steps=1, engine_depths=(1, 2), engine_wide=None,
                   engine_steps=2, engine_rounds=1, families=("amp",), deepspeed=False, disk_bytes=1 * MiB,
                   in_step=False)


def nonneg_lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best over the subsets of unknowns whose solution is >= 0."""
    import itertools

    best, best_err = [0.0] * len(rows[0]), float("inf")
    n = len(rows[0])
    for keep in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(1, n + 1)):
        a = torch.tensor([[r[i] for i in keep] for r in rows], dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        x = torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()
        if any(v < 0 for v in x):
            continue
        coef = [0.0] * n
        for i, v in zip(keep, x):
            coef[i] = v
        err = sum((sum(c * r[i] for i, c in enumerate(coef)) - yy) ** 2 for r, yy in zip(rows, ys))
        if err < best_err:
            best, best_err = coef, err
    return best

@contextlib.contextmanager
def at_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_of(fn, min_time: float, threads: int | None = None) -> tuple[float, float]:
    """(fastest, median) seconds of one call of ``fn`` at ``threads`` (default: the training's), repeated for
    ``min_time``. Calls under 100 us run in blocks (torch.utils.benchmark sizes them so its own cost does not
    count); longer ones one by one, so a call another process interrupted does not spoil its neighbours."""
    threads = threads or torch.get_num_threads()
    with at_threads(threads):
        # Warm-up for half of min_time: on a busy CPU the first parallel ops after a pause wait ~20 ms each for
        # their threads (seen for the first 6 calls of a 64 x 64 matmul that then took 7 us), and the fastest
        # warm-up call decides how to time.
        warm, until = [], time.perf_counter() + min_time / 2
        while not warm or (min(warm) >= 1e-4 and len(warm) < 20 and time.perf_counter() < until):
            warm.append(once(fn))
        if min(warm) < 1e-4:
            from torch.utils.benchmark import Timer

            m = Timer("fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(min_run_time=min_time)
            return min(m.times), m.median
        # long calls: a warm-up call is a sample too
        times = repeat(fn, min_time, warm if min(warm) > min_time / 4 else ())
    return min(times), statistics.median(times)


def best_of_guarded(fn, s: Sizes) -> tuple[float, float]:
    """:func:`best_of`, unless a call takes over ``max_call_s``: then the faster of two calls is the sample
    (the first of a shape may include generating its kernel, as oneDNN does for bf16)."""
    first = once(fn)
    if first > s.max_call_s:
        best = min(first, once(fn))
        return best, best
    return best_of(fn, s.min_time_s)


def tiny_config(depth: int, hidden: int | None = None):
    from transformers import LlamaConfig

    wide = {"hidden_size": hidden, "intermediate_size": 3 * hidden} if hidden else {}
    return LlamaConfig(num_hidden_layers=depth, **{**TINY, **wide})


def tiny_model(depth: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                hidden: int | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(depth, hidden), attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    return model.to(device) if device is not None else model


def op_built(name: str) -> str | None:
    """None when DeepSpeed's op ``name`` loads without compiling (installed with DeepSpeed, or JIT-built and up
    to date for the ninja runs use); else why not. Loading an unbuilt op compiles it, minutes: calibration
    never does that."""

    try:
        st = op_state(name, use_env_ninja())
    except Exception as e:  # noqa: BLE001 -- DeepSpeed not importable: the caller asked deepspeed_status first
        return f"{type(e).__name__}: {e}"
    if not st.compiles:
        return None
    return (f"DeepSpeed's {name} op is {st.state}{': ' + st.detail if st.state == 'stale' else ''} (vramfit doctor "
            "--build-ops builds it, minutes once)")
