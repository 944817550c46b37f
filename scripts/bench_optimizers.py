#!/usr/bin/env python
"""Time one AdamW step on the CPU for each optimizer an offload path could use.

The parameters are fp32 with fp32 gradients, shaped like whole Llama decoder layers (four
hidden x hidden attention matrices, three hidden x intermediate MLP matrices, two norms), because
optimizers that launch per-tensor work (for-loop, foreach) pay per tensor, not only per element.
The default is two layers of hidden 1024 (llama-350m), 25.7M parameters: small enough to run in
about a minute on 2 cores; times are also given per 100M parameters (the step does the same work for
every element, so its time scales linearly: it reads parameter, gradient and both moments and writes
back three, 28 bytes per parameter). All optimizers are built first (16 bytes per parameter each, 2 GB at the default size) and
stepped in turns, so that a load change on a shared machine hits them alike; the load average is printed.

    python scripts/bench_optimizers.py                 # the table
    python scripts/bench_optimizers.py --json          # machine-readable
    python scripts/bench_optimizers.py --layers 8      # 103M parameters, closer to a real model
    python scripts/bench_optimizers.py --hidden 64 --intermediate 192 --layers 1 --warmup 1 --steps 2 --no-compile
                                                       # a quick check that every path still runs

Optimizers: DeepSpeedCPUAdam (what ZeRO-Offload uses), DeepSpeed FusedAdam as built for a CPU-only
host (what ZeRO without offload uses on the CPU accelerator), and torch.optim.AdamW with the
for-loop, foreach and fused implementations (fused: what the FSDP offload path uses).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time

import torch


def layer_shapes(hidden: int, intermediate: int, layers: int) -> list[tuple[int, ...]]:
    one = [(hidden, hidden)] * 4 + [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    one += [(hidden,), (hidden,)]
    return one * layers


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def candidates(lr: float, betas, eps: float, weight_decay: float, compile_ops: bool = True):
    """(name, factory or None, why not) for every optimizer that can run here. ``compile_ops=False``: a DeepSpeed
    optimizer whose op would be compiled first is left out (said in its why not) instead of built."""
    out = []
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    uncompiled = {}  # op name -> why it is not loaded
    try:  # the ninja vramfit's runs use, and a word before DeepSpeed compiles an op (minutes)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from launcher.machine.deepspeed_ops import op_state, use_env_ninja

        ninja = use_env_ninja()
        for name in ("cpu_adam", "fused_adam"):
            st = op_state(name, ninja)
            if st.compiles and not compile_ops:
                uncompiled[name] = f"not loaded (--no-compile): its op {name} is {st.state}"
            elif st.compiles:
                print(st.notice(), file=sys.stderr)
    except ImportError:
        pass
    try:
        if "cpu_adam" in uncompiled:
            raise RuntimeError(uncompiled["cpu_adam"])
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out.append(("DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **kw), None))
    except Exception as e:  # not installed, or the op cannot be built here
        out.append(("DeepSpeedCPUAdam", None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    try:
        if "fused_adam" in uncompiled:
            raise RuntimeError(uncompiled["fused_adam"])
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import FusedAdam

        if get_accelerator().device_name() != "cpu":
            raise RuntimeError("DeepSpeed FusedAdam needs the accelerator's device; here it is not the CPU")
        out.append(("DeepSpeed FusedAdam (CPU build)", lambda ps: FusedAdam(ps, adam_w_mode=True, **kw), None))
    except Exception as e:
        out.append(("DeepSpeed FusedAdam (CPU build)", None,
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    out.append(("torch AdamW for-loop", lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), None))
    out.append(("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw), None))
    out.append(("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw), None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the layer shapes (default 1024)")
    ap.add_argument("--intermediate", type=int, default=2816, help="MLP size (default 2816)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of parameters (default 2: 25.7M)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out a DeepSpeed optimizer whose op is not built yet (building it takes minutes)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.hidden, args.intermediate, args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    rows, live = [], []
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; keep --json clean
        found = candidates(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, compile_ops=not args.no_compile)
    for name, factory, why_not in found:
        if factory is None:
            rows.append({"optimizer": name, "available": False, "why_not": why_not})
            continue
        opt = factory(make_params(shapes))
        for _ in range(args.warmup):  # the first steps allocate the moments; later ones are steady state
            opt.step()
        row = {"optimizer": name, "available": True}
        rows.append(row)
        live.append((row, opt, []))
    for _ in range(args.steps):
        for _row, opt, times in live:
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    for row, _opt, times in live:
        times.sort()
        median = times[len(times) // 2]
        row.update({"step_s_median": median, "step_s_min": times[0], "step_s_per_100m": median * 1e8 / n,
                    "gb_per_s": 28 * n / median / 1e9})
    del live
    gc.collect()
    fused = next((r for r in rows if r["optimizer"] == "torch AdamW fused"), None)
    for r in rows:
        if r["available"] and fused:
            r["vs_torch_fused"] = r["step_s_median"] / fused["step_s_median"]
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "python": platform.python_version(),
               "load_average": [round(x, 2) for x in os.getloadavg()]}
    try:
        import deepspeed

        machine["deepspeed"] = deepspeed.__version__
    except Exception:
        machine["deepspeed"] = None
    result = {"params": n, "tensors": len(shapes), "shapes": f"{args.layers} x Llama layer (hidden {args.hidden}, "
              f"intermediate {args.intermediate})", "warmup": args.warmup, "steps": args.steps,
              "machine": machine, "results": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"AdamW step on the CPU, fp32 params and grads: {n / 1e6:.1f}M parameters in {len(shapes)} tensors "
          f"({result['shapes']}); median of {args.steps} steps each, taken in turns, after {args.warmup} warm-up")
    print(f"machine: {machine['cores']} cores, {machine['torch_threads']} torch threads, torch {machine['torch']}, "
          f"deepspeed {machine['deepspeed']}, load average {machine['load_average'][0]}")
    print()
    print("| optimizer | step (s) | s per 100M params | memory GB/s (28 B/param) | vs torch fused |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if not r["available"]:
            print(f"| {r['optimizer']} | n/a | n/a | n/a | {r['why_not']} |")
            continue
        print(f"| {r['optimizer']} | {r['step_s_median']:.3f} | {r['step_s_per_100m']:.3f} | "
              f"{r['gb_per_s']:.1f} | {r.get('vs_torch_fused', float('nan')):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
