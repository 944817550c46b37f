"""Entry for launchers: ``deepspeed launcher/run.py [CONFIG] [key=value ...]`` (same as ``vramfit train``).

Also works as ``python launcher/run.py ...`` and ``torchrun --nproc_per_node N launcher/run.py ...``.
The DeepSpeed launcher appends ``--local_rank=N``; it is accepted and dropped (LOCAL_RANK is set too).
"""

import os
import sys

if __package__ in (None, ""):  # run as a file path: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.cli import launched_ranks, main  # noqa: E402


def run() -> int:
    return main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    code = run()
    if launched_ranks() > 1:  # launcher variables that cannot be read were refused by run(): one process
        from launcher.machine import dist

        dist.leave(code)  # without the interpreter's teardown, which a gloo group can abort (dist.leave)
    sys.exit(code)
