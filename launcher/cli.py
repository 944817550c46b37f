"""Command line: ``vramfit doctor | plan | tune | profiles | train | bench | export | plot | config-reference``.

Commands only: each parses its arguments, calls the module that does the work and prints the result. The
commands import their modules when they run, so that ``vramfit --help`` and a typo answer at once instead of
after importing torch, transformers and DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

from launcher import log
from launcher.config.checks import folder_problem
from launcher.config.schema import Config, ConfigError
from launcher.machine import dist
from launcher.machine.files import DiskFull

EPILOG = """config: an optional YAML file, then key=value overrides, e.g.
  vramfit train                                   # the built-in demo (tiny Llama, synthetic task)
  vramfit train my.yaml train.max_steps=500 model.gradient_checkpointing=true
  vramfit plan model.name=llama-7b data.seq_len=2048 memory.gpu_budget=16 lora.r=16
Every key is listed by `vramfit config-reference`."""


class Parser(argparse.ArgumentParser):
    """argparse with its refusals in vramfit's words: the value, the rule and the fix (argparse names the value;
    the rule and the fix point at the command's own --help), exit code 2, stderr only."""

    def error(self, message: str):
        if "rule:" not in message:
            helps = f"`{self.prog} --help`"
            if message.startswith("the following arguments are required"):
                message += f"; rule: {self.prog} needs them; fix: add them ({helps} says what each takes)"
            elif message.startswith("unrecognized arguments"):
                message += (f"; rule: the options {helps} lists" + (", and key=value overrides" if any(
                    a.dest == "config" for a in self._actions) else "") + f"; fix: remove it or spell it as {helps} does")
            else:
                message += f"; rule: as {helps} says; fix: correct it as {helps} shows"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


class Number:
    """An argparse type: a finite whole number (``kind=int``) or number within ``lo`` (inclusive) or ``above``
    (exclusive); a value outside says the value, the rule and the fix (``fix``: a good value). The fuzzer
    (tests/test_fuzz.py) reads these bounds to make its bad values."""

    def __init__(self, kind: type, *, lo: float | None = None, above: float | None = None, fix):
        self.kind, self.lo, self.above, self.fix = kind, lo, above, fix
        self.__name__ = "whole number" if kind is int else "number"  # argparse names the type in its own messages

    @property
    def rule(self) -> str:
        what = "a whole number" if self.kind is int else "a finite number"
        return what + (f" >= {self.lo:g}" if self.lo is not None else "") + (
            f" > {self.above:g}" if self.above is not None else "")

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value is None or (self.kind is float and not math.isfinite(value)) \
                or (self.lo is not None and value < self.lo) or (self.above is not None and value <= self.above):
            raise argparse.ArgumentTypeError(f"got {text!r}; rule: {self.rule}; fix: {self.fix}")
        return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, a command's options and ``key=value`` overrides in any order (``parse_intermixed_args``:
    ``vramfit plan --gpu T4 lora.r=16`` as well as ``vramfit plan lora.r=16 --gpu T4``). argparse cannot mix
    them across a parser with subcommands, so the command's own parser reads what follows the command's name."""
    parser = build_parser()
    if argv and argv[0] in parser.commands:
        args = parser.commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # no command, an unknown one, or --help: argparse's own answer


def _split_config(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is the CONFIG path when it is not a key=value override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def strip_local_rank(argv: list[str]) -> list[str]:
    """Drop the ``--local_rank=N`` / ``--local_rank N`` that the DeepSpeed launcher appends (it also sets LOCAL_RANK)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
            continue
        if a in ("--local_rank", "--local-rank"):
            if i + 1 < len(argv):
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
            continue
        out.append(a)
    return out


@contextlib.contextmanager
def results_stdout():
    """While a command works, everything written to stdout (file descriptor 1: DeepSpeed's logger, a JIT
    compiler, a library's print) goes to stderr; the command's result is written to the real stdout through
    the returned stream, so stdout holds the table or the JSON document alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as real:
            yield real
            real.flush()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_doctor(args) -> int:
    from launcher.machine import speeds, threads
    from launcher.machine.hardware import format_report, probe
    from launcher.measure import calibrate

    out = args.stdout
    hw = probe(with_cpu_adam=True)
    hw.threads = threads.current()
    if args.build_ops:
        from launcher.machine.deepspeed_ops import build_ops

        print(build_ops(), file=sys.stderr)
        hw = probe(with_cpu_adam=True)
        hw.threads = threads.current()
    if args.calibrate:
        calibrate.calibration(force=True)  # measured now (under a minute) and cached
    cal = speeds.read()
    disk = output_disk(Config().output_dir)
    doc = {**hw.to_dict(), "calibration": cal.to_dict(), "output_disk": disk}
    print(json.dumps(doc, indent=2) if args.json else format_report(hw) + "\n" + speeds.format_report(cal)
          + f"\noutput disk: {disk['free_text']} free of {disk['total_text']} under {disk['output_dir']} "
          "(output_dir's default; `vramfit plan` sets a run's checkpoints and final/ against it)", file=out)
    return 0


def output_disk(output_dir: str) -> dict:
    """Free and total bytes of the disk that holds ``output_dir`` (its nearest existing parent)."""
    import shutil

    from launcher.machine.files import free_bytes, size_text

    p = os.path.abspath(output_dir)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    total = shutil.disk_usage(p).total
    free = free_bytes(p) or 0
    return {"output_dir": os.path.abspath(output_dir), "free_bytes": free, "total_bytes": total,
            "free_text": size_text(free), "total_text": size_text(total)}


def cmd_profiles(args) -> int:
    from launcher.config import profiles

    if args.check:
        problems = profiles.check_all(args.dir)
        if problems:
            print(f"vramfit: --dir {args.dir}: {len(problems)} file(s) differ from the profile catalogue; rule: "
                  "ds_configs/ is written from the catalogue, file for file; fix: run `vramfit profiles"
                  + (f" --dir {args.dir}" if args.dir != profiles.DS_CONFIG_DIR else "") + "` to regenerate them:\n  "
                  + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"{sum(p.is_deepspeed for p in profiles.PROFILES.values())} DeepSpeed profiles in {args.dir} match the code",
              file=args.stdout)
        return 0
    problem = folder_problem("--dir", args.dir, "a folder this user can write, for the DeepSpeed JSON files",
                             "--dir DIR that you can write (the default is the repository's ds_configs/)")
    if problem:
        raise ConfigError([problem], "command line")
    for path in profiles.write_all(args.dir):
        print(f"wrote {path}", file=args.stdout)
    print(profiles.table_markdown(), file=args.stdout)
    return 0


def cmd_plan(args) -> int:
    from launcher.plan import tracestore
    from launcher.plan.memory import estimate

    with estimate.parallel(tracestore.workers()):  # a cold plan is mostly tracing
        return _plan(args)


def _plan(args) -> int:
    from launcher.config.load import load_config
    from launcher.log import logger
    from launcher.machine import diskspace, speeds
    from launcher.machine.hardware import probe, with_nvme
    from launcher.measure import calibrate
    from launcher.plan import compare, decide, gpus, report

    path, overrides = _split_config(args.config)
    out = args.stdout
    if args.price and not args.compare_gpus:
        raise ConfigError([f"--price: got {args.price!r} without --compare-gpus; rule: prices cost a comparison of "
                           "GPUs; fix: add --compare-gpus"], "command line")
    if args.gpu and args.compare_gpus:
        raise ConfigError(["--gpu with --compare-gpus; rule: one GPU, or all of them; fix: drop one"], "command line")
    several = args.gpus is not None or args.nodes != 1 or args.network_gbps is not None
    if several and not (args.gpu or args.compare_gpus):
        raise ConfigError(["--gpus/--nodes/--network-gbps without --gpu or --compare-gpus; rule: they plan cards of "
                           "the catalogue (a run on this machine takes its ranks from the launcher); fix: add --gpu "
                           "NAME (or --compare-gpus)"], "command line")
    counts = compare.parse_counts(args.gpus)
    if args.gpu and len(counts) > 1:
        raise ConfigError([f"--gpus: got {args.gpus!r} with --gpu; rule: one count per plan, several only with "
                           f"--compare-gpus; fix: --gpus {counts[-1]}"], "command line")
    network = args.network_gbps if args.network_gbps is not None else gpus.DEFAULT_NETWORK_GBPS
    cfg = load_config(path, overrides)
    if several:
        compare.check_counts(cfg, counts, args.nodes)
    spec = gpus.find(args.gpu) if args.gpu else None  # a bad name fails before anything is measured
    prices = compare.parse_prices(args.price) if args.compare_gpus else {}
    world = dist.current().world
    if args.compare_gpus:
        # every card of the catalogue over this host: the host's share of every row is priced with its speeds
        cfg, note = decide.settled(cfg, strict=False)
        if note:
            logger.info(note)
        host, notes = decide.checked(calibrate.load_or_calibrate())
        for line in notes:  # the table has no header to say them
            logger.warning(line)
        rows = compare.compare(cfg, with_nvme(probe(), cfg.memory.nvme_path), host, prices, world=world,
                               counts=counts if several else None, nodes=args.nodes, network_gbps=network)
        print(json.dumps({"gpus": [r.to_dict() for r in rows], "max_steps": cfg.train.max_steps}, indent=2)
              if args.json else compare.table(rows, cfg.train.max_steps), file=out)
        return 0 if any(r.fits for r in rows) else 2
    nodes, links = 1, None
    if spec is not None:  # plan for a card that is not here: its data sheet, this machine as its host
        machine = calibrate.load_or_calibrate()
        if several:
            world, nodes, links = counts[0] * args.nodes, args.nodes, gpus.links(spec, network)
    else:  # this machine, priced when it has been calibrated (vramfit doctor --calibrate)
        machine, why = speeds.cached()
        if why:
            logger.warning(why)
    d = decide.decide(cfg, hw=probe(), machine=machine, world=world, card=spec, run=False,
                      alternatives=args.alternatives, nodes=nodes, links=links, lenient_data=True)
    for line in d.notes:  # a doubtful or busy machine is said in the table's header
        if line.startswith("data not read"):
            logger.info(line)
    cfg, plan = d.cfg, d.plan
    row = plan.chosen_plan
    disk = (diskspace.room(cfg.output_dir, row.checkpoint_bytes, row.final_bytes, cfg.checkpoint.keep_last)
            if row is not None and cfg.checkpoint.save else None)
    doc = {**plan.to_json(), "disk": disk}
    text = report.format_table(plan) + (f"\n{diskspace.describe(disk)}" if disk else "")
    print(json.dumps(doc, indent=2) if args.json else text, file=out)
    return 0 if plan.chosen else 2


def cmd_tune(args) -> int:
    from launcher.measure import tune

    path, overrides = _split_config(args.config)
    doc = tune.tune(path, overrides, top=args.top, out_yaml=args.out, out_dir=args.dir, steps=args.steps,
                    warmup=args.warmup, timeout=args.timeout)
    print(tune.table(doc), file=args.stdout)
    return 0


def cmd_train(args) -> int:
    from launcher.config.load import load_config
    from launcher.training.faults import EXIT_FAILED, EXIT_INTERRUPTED
    from launcher.training.loop import train

    path, overrides = _split_config(args.config)
    cfg = load_config(path, overrides)
    summary = train(cfg)
    return {"completed": 0, "stopped_early": 0, "interrupted": EXIT_INTERRUPTED}.get(summary["status"], EXIT_FAILED)


def cmd_bench(args) -> int:
    from launcher.measure import bench

    path, overrides = _split_config(args.config)
    doc = bench.main(path, overrides, profiles=args.profiles, out=args.out, steps=args.steps, warmup=args.warmup,
                     find=args.find, timeout=args.timeout, candidates=args.candidates)
    print(bench.markdown(doc), file=args.stdout)  # the table last, on stdout
    return 0 if any(r.get("status") == bench.STATUS_OK for r in doc["results"]) else 1


def cmd_export(args) -> int:
    from launcher.model.export import export

    print(export(args.run_dir, args.out, merge=args.merge, base=args.base), file=args.stdout)
    return 0


def cmd_plot(args) -> int:
    from launcher.training.plots import plot_run

    _check_plot_dir(args.run_dir)
    print(plot_run(args.run_dir), file=args.stdout)
    return 0


def _check_plot_dir(run_dir: str) -> None:
    """``vramfit plot RUN_DIR``: a run directory with a readable memory.csv (and, when there, summary.json and
    metrics.jsonl), where memory.png can be written; every problem at once, before anything is drawn."""
    from launcher.training.monitor import read_csv

    fix = "fix: vramfit plot runs/<run_name> (a folder vramfit train made)"
    if not os.path.isdir(run_dir):
        what = "a file" if os.path.exists(run_dir) else "no such folder"
        raise ConfigError([f"RUN_DIR: got {run_dir!r}, {what}; rule: a run directory; {fix}"], "command line")
    csv_path = os.path.join(run_dir, "memory.csv")
    if not os.path.isfile(csv_path):
        why = ("the run had log.memory_interval_s=0 (no memory monitor)" if os.path.isfile(
            os.path.join(run_dir, "config.yaml")) else "not a run directory")
        raise ConfigError([f"RUN_DIR: {run_dir!r} has no memory.csv ({why}); rule: plot draws a run's memory timeline; "
                           f"{fix}, of a run with the memory monitor on (log.memory_interval_s > 0)"], "command line")
    def summary(path):
        with open(path) as fh:
            if not isinstance(json.load(fh), dict):
                raise ValueError("not a JSON object")

    def metrics(path):
        with open(path) as fh:
            for i, line in enumerate(fh, 1):
                row = json.loads(line) if line.strip() else {"step": 0, "time_s": 0}
                if not (isinstance(row, dict) and isinstance(row.get("step"), int)
                        and isinstance(row.get("time_s"), (int, float))):
                    raise ValueError(f"line {i} is not a row with step and time_s")

    problems = []
    for name, read in (("memory.csv", read_csv), ("summary.json", summary), ("metrics.jsonl", metrics)):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        try:
            read(path)
        except (OSError, ValueError) as e:  # csv, JSON, float() and decoding errors are ValueErrors
            problems.append(f"RUN_DIR: {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}); rule: "
                            f"the {name} vramfit train wrote; fix: restore it (or move it away: the plot is drawn "
                            "without it" + (")" if name != "memory.csv" else "; memory.csv is needed)"))
    problems += filter(None, [folder_problem("RUN_DIR", run_dir, "memory.png is written into the run directory",
                                             f"make it writable (chmod u+w {run_dir}), or copy the run elsewhere")])
    if problems:
        raise ConfigError(problems, "command line")


def cmd_config_reference(args) -> int:
    from launcher.config.schema import reference_markdown

    print(reference_markdown(), file=args.stdout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="vramfit", description="Fit mixed-precision fine-tuning into a small GPU.",
               epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    p.commands = sub.choices  # name -> the command's parser (parse_args reads a command's arguments with it)

    d = sub.add_parser("doctor", help="what this machine can run and how fast (GPUs, RAM, ulimit -l, DeepSpeed ops, "
                                      "calibration)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--build-ops", action="store_true", help="JIT-build DeepSpeed's ops (CPU Adam) now, a few minutes once")
    d.add_argument("--calibrate", action="store_true",
                   help="measure this machine's speeds for the step-time model now (under a minute) and cache them")
    d.set_defaults(fn=cmd_doctor)

    pr = sub.add_parser("profiles", help="write ds_configs/*.json from the catalogue, or --check them")
    pr.add_argument("--check", action="store_true", help="fail when ds_configs/ differs from the code")
    from launcher.config.profiles import DS_CONFIG_DIR

    pr.add_argument("--dir", default=DS_CONFIG_DIR, help="where the JSON files live (default: %(default)s)")
    pr.set_defaults(fn=cmd_profiles)

    for name, fn, hlp in (("train", cmd_train, "train (no CONFIG: the built-in demo)"),
                          ("plan", cmd_plan, "predict GPU and CPU memory for every profile and pick one")):
        s = sub.add_parser(name, help=hlp, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        s.add_argument("config", nargs="*", metavar="[CONFIG] [key=value ...]")
        if name == "plan":
            s.add_argument("--json", action="store_true", help="machine-readable output")
            s.add_argument("--gpu", default=None, metavar="NAME",
                           help="plan for a GPU of the catalogue that is not here (T4, L4, A10G, RTX3090, ...; "
                                "memory.cpu_budget=GiB for the rented host's RAM)")
            s.add_argument("--compare-gpus", action="store_true",
                           help="a row per catalogue GPU: fits, setup, tokens/s, hours and cost of the run")
            s.add_argument("--price", default=None, metavar="NAME=USD_PER_H,...",
                           help="with --compare-gpus: prices per hour, e.g. T4=0.35,L4=0.80")
            s.add_argument("--gpus", default=None, metavar="N[,N...]",
                           help="with --gpu: N cards per machine (per-rank memory, communication priced); with "
                                "--compare-gpus: the counts to compare, e.g. 1,2,4")
            s.add_argument("--nodes", type=Number(int, lo=1, fix="--nodes 1"), default=1, metavar="M",
                           help="machines of --gpus cards each (default: %(default)s)")
            s.add_argument("--network-gbps", type=Number(float, above=0, fix="--network-gbps 10"), default=None,
                           metavar="G", help="the network between machines, Gbit/s (default: 10)")
            s.add_argument("--alternatives", action="store_true",
                           help="also when a setting fits: other ways to run the job (4-bit base, LoRA, a shorter "
                                "sequence, a bigger card), each re-planned with its tokens/s (when nothing fits "
                                "they are always listed)")
        s.set_defaults(fn=fn)

    tu = sub.add_parser("tune", help="measure the planner's fastest few settings and keep the fastest measured",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tu.add_argument("config", nargs="*", metavar="[CONFIG] [key=value ...]")
    tu.add_argument("--top", type=Number(int, lo=1, fix="--top 3"), default=3,
                    help="settings to measure, fastest predicted first (default: %(default)s)")
    tu.add_argument("--out", default=None, metavar="FILE.yaml", help="write the fastest measured settings here")
    tu.add_argument("--dir", default="tune-out", help="where the runs and logs go (default: %(default)s)")
    tu.add_argument("--steps", type=Number(int, lo=1, fix="--steps 6"), default=6,
                    help="timed steps per setting (default: %(default)s)")
    tu.add_argument("--warmup", type=Number(int, lo=0, fix="--warmup 2"), default=2,
                    help="untimed warm-up steps (default: %(default)s)")
    tu.add_argument("--timeout", type=Number(float, above=0, fix="--timeout 1800"), default=1800,
                    help="seconds per run (default: %(default)s)")
    tu.set_defaults(fn=cmd_tune)

    b = sub.add_parser("bench", help="the same workload under several profiles, each in its own process")
    b.add_argument("config", nargs="*", metavar="[CONFIG] [key=value ...]")
    b.add_argument("--profiles", default=None, help="comma-separated profile names (default: every one that applies)")
    b.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    b.add_argument("--steps", type=Number(int, lo=1, fix="--steps 10"), default=10,
                   help="timed steps per profile (default: %(default)s)")
    b.add_argument("--warmup", type=Number(int, lo=0, fix="--warmup 3"), default=3,
                   help="untimed warm-up steps (default: %(default)s)")
    b.add_argument("--find", choices=("micro-batch", "model"), default=None,
                   help="per profile, find the largest micro-batch or size preset that fits the GPU budget")
    b.add_argument("--candidates", default=None,
                   help="with --find: comma-separated micro-batches or model presets to try (default: powers of two "
                        "dividing the global batch, or every size preset)")
    b.add_argument("--timeout", type=Number(float, above=0, fix="--timeout 1800"), default=1800,
                   help="seconds per training run (default: %(default)s)")
    b.set_defaults(fn=cmd_bench)

    e = sub.add_parser("export", help="write a standalone model from a run (merging a LoRA adapter)")
    e.add_argument("run_dir")
    e.add_argument("--out", required=True, help="directory to write (must not exist)")
    e.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base weights")
    e.add_argument("--base", default=None, metavar="DIR",
                   help="with --merge: the base model to merge into, where the run's model.name has moved")
    e.set_defaults(fn=cmd_export)

    pl = sub.add_parser("plot", help="redraw a run's memory.png from its memory.csv and metrics")
    pl.add_argument("run_dir")
    pl.set_defaults(fn=cmd_plot)

    c = sub.add_parser("config-reference", help="print every config key with its default and meaning")
    c.set_defaults(fn=cmd_config_reference)
    return p


def _planning_process() -> None:
    """For a process started to plan (``vramfit plan``), which loads no weights: a plan prices 4-bit and 8-bit
    weights by arithmetic and traces LoRA on meta tensors, so it never uses bitsandbytes. peft imports bitsandbytes
    as it is itself imported (``peft.helpers``; about a second on a small CPU, with the ``torch._inductor`` that
    pulls in), so this process hides it: peft then runs as where bitsandbytes is not installed. Only where
    ``main`` starts the process (no ``argv`` given): code that calls ``main`` may go on to train in the same
    process."""
    if "peft" not in sys.modules and "bitsandbytes" not in sys.modules:
        from launcher.machine.deepspeed_ops import hide_module

        hide_module("bitsandbytes")


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: the arguments after the program's name; None: ``sys.argv``). A process started
    as one rank of several (``vramfit``, ``python -m launcher`` under a launcher) ends here, past the interpreter's
    teardown (:func:`launcher.machine.dist.leave`); ``launcher/run.py`` does the same."""
    code = _main(argv)
    if argv is None and launched_ranks() > 1:
        dist.leave(code)
    return code


def launched_ranks() -> int:
    """The ranks the launcher's variables say, 1 where they cannot be read (``_main`` has said why, and exits 2)."""
    try:
        return dist.current().world
    except dist.EnvError:
        return 1


def _main(argv: list[str] | None = None) -> int:
    import warnings

    # transformers' deprecation notices about its own internals say nothing a user can act on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    argv_given = argv
    argv = strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    args = parse_args(argv)
    if argv_given is None and args.fn is cmd_plan:
        _planning_process()
    try:
        log.setup(rank=dist.current().rank)
        from launcher.plan import tracestore  # late: it imports torch, which --help and bad arguments need not wait for

        tracestore.install()  # a model planned before is not traced again
        with results_stdout() as args.stdout:
            return args.fn(args)
    except dist.EnvError as e:  # no rank to go by: every process says it
        print(f"vramfit: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        if dist.current().is_main:  # every rank finds the same problems: one copy is enough
            print(f"vramfit: {e}", file=sys.stderr)
        return 2
    except DiskFull as e:  # a write outside the loop (the loop itself ends such a run with a summary)
        print(f"vramfit: {e}; fix: free space there or choose another output_dir", file=sys.stderr)
        return 1
    finally:
        dist.shutdown(keep_single=argv_given is not None)  # an in-process caller's group of one serves its next call


if __name__ == "__main__":
    sys.exit(main())
