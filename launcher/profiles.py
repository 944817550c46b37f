"""The profile catalogue: the one source of truth for every engine/precision/offload combination.

``vramfit profiles`` writes ``ds_configs/NAME.json`` for every DeepSpeed profile from this table;
``vramfit profiles --check`` fails when the files and the code disagree. The JSON files keep
``"auto"`` where the value depends on the run (batch sizes, clipping, lr, bucket sizes); at launch
:func:`resolve_ds_config` replaces every one of them, and the resolved config is written to the
run directory. DeepSpeed itself never sees ``"auto"``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

AUTO = "auto"
DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")

# fp16 dynamic loss scaling, shared by DeepSpeed profiles and torch.amp.GradScaler.
LOSS_SCALE = {"initial_power": 16, "window": 1000, "hysteresis": 2, "min_scale": 1}


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str  # 'amp' | 'fsdp' | 'deepspeed'
    precision: str  # 'fp16' | 'bf16' | 'fp32'
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    speed_rank: int = 0  # 1 = fastest family; used to pick "the fastest profile that fits"
    gpu_holds: str = ""
    cpu_holds: str = ""

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer or self.offload_param

    @property
    def is_deepspeed(self) -> bool:
        return self.engine == "deepspeed"


def _catalogue() -> dict[str, Profile]:
    out: dict[str, Profile] = {}

    def add(p: Profile):
        out[p.name] = p

    # Order within the table is the order `vramfit profiles` prints; speed_rank orders the families.
    for prec in ("fp16", "bf16", "fp32"):
        add(Profile(f"amp-{prec}", "amp", prec, speed_rank=1,
                    gpu_holds="everything (fp32 weights, grads, Adam states, activations)", cpu_holds="nothing"))
    for prec in ("fp16", "bf16", "fp32"):
        add(Profile(f"zero2-{prec}", "deepspeed", prec, zero_stage=2, speed_rank=1,
                    gpu_holds="everything", cpu_holds="nothing"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero2-{prec}-offload-opt", "deepspeed", prec, zero_stage=2, offload_optimizer=True, speed_rank=2,
                    gpu_holds="16-bit weights, buckets, activations", cpu_holds="fp32 master, Adam m and v, grads"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"fsdp-{prec}-offload", "fsdp", prec, offload_optimizer=True, offload_param=True, speed_rank=3,
                    gpu_holds="one layer's params, activations", cpu_holds="params, grads, optimizer"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero3-{prec}-offload-all", "deepspeed", prec, zero_stage=3, offload_optimizer=True,
                    offload_param=True, speed_rank=4, gpu_holds="live layers, activations",
                    cpu_holds="everything else"))
    return out


PROFILES: dict[str, Profile] = _catalogue()


def get(name: str) -> Profile:
    return PROFILES[name]


def ds_config_template(p: Profile) -> dict:
    """The DeepSpeed config of a profile, with ``"auto"`` where the run decides."""
    if not p.is_deepspeed:
        raise ValueError(f"{p.name} is not a DeepSpeed profile")
    zero: dict = {"stage": p.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": AUTO}
    if p.zero_stage == 2:
        zero["allgather_bucket_size"] = AUTO
        zero["reduce_scatter"] = True
    if p.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": AUTO, "stage3_param_persistence_threshold": AUTO,
                     "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": AUTO}
    if p.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": AUTO}
    cfg: dict = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "steps_per_print": 1_000_000_000,  # vramfit logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
        "zero_optimization": zero,
        "fp16": {"enabled": p.precision == "fp16"},
        "bf16": {"enabled": p.precision == "bf16"},
    }
    if p.precision == "fp16":
        cfg["fp16"].update({"loss_scale": 0, "initial_scale_power": LOSS_SCALE["initial_power"],
                            "loss_scale_window": LOSS_SCALE["window"], "hysteresis": LOSS_SCALE["hysteresis"],
                            "min_loss_scale": LOSS_SCALE["min_scale"]})
    return cfg


def bucket_sizes(hidden_size: int) -> dict:
    """Bucket sizes from the hidden size, as Accelerate's DeepSpeed plugin resolves them."""
    h2 = hidden_size * hidden_size
    return {"reduce_bucket_size": h2, "allgather_bucket_size": h2,
            "stage3_prefetch_bucket_size": int(0.9 * h2), "stage3_param_persistence_threshold": 10 * hidden_size}


def resolve_ds_config(p: Profile, *, micro_batch: int, accumulation: int, world: int, grad_clip: float, lr: float,
                      betas: tuple[float, float], eps: float, weight_decay: float, hidden_size: int,
                      pin_memory: bool, loss_scale: dict | None = None) -> dict:
    """Fill every ``"auto"`` of the profile's config. Raises if one would survive."""
    cfg = json.loads(json.dumps(ds_config_template(p)))
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = accumulation
    cfg["train_batch_size"] = micro_batch * accumulation * world
    cfg["gradient_clipping"] = grad_clip
    cfg["optimizer"]["params"] = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}
    zero = cfg["zero_optimization"]
    for k, v in bucket_sizes(hidden_size).items():
        if zero.get(k) == AUTO:
            zero[k] = v
    for k in ("offload_optimizer", "offload_param"):
        if k in zero:
            zero[k]["pin_memory"] = bool(pin_memory)
    if p.precision == "fp16" and loss_scale:
        cfg["fp16"].update({"initial_scale_power": loss_scale["initial_power"],
                            "loss_scale_window": loss_scale["window"], "hysteresis": loss_scale["hysteresis"],
                            "min_loss_scale": loss_scale["min_scale"]})
    left = find_auto(cfg)
    if left:
        raise RuntimeError(f"unresolved 'auto' in the DeepSpeed config of {p.name}: {left}")
    return cfg


def find_auto(obj, path: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in find_auto(v, f"{path}[{i}]")]
    return [path] if obj == AUTO else []


def render(p: Profile) -> str:
    return json.dumps(ds_config_template(p), indent=2, sort_keys=False) + "\n"


def write_all(directory: str = DS_CONFIG_DIR) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    written = []
    for p in PROFILES.values():
        if p.is_deepspeed:
            path = os.path.join(directory, f"{p.name}.json")
            with open(path, "w") as fh:
                fh.write(render(p))
            written.append(path)
    return written


def check_all(directory: str = DS_CONFIG_DIR) -> list[str]:
    """Differences between ``directory`` and the code (empty when they agree)."""
    problems = []
    want = {f"{p.name}.json": render(p) for p in PROFILES.values() if p.is_deepspeed}
    have = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    for fname, text in want.items():
        path = os.path.join(directory, fname)
        if fname not in have:
            problems.append(f"{path}: missing")
        elif open(path).read() != text:
            problems.append(f"{path}: differs from the code")
    for fname in sorted(have - set(want)):
        if fname.endswith(".json"):
            problems.append(f"{os.path.join(directory, fname)}: no such profile in the code")
    return problems


def table_markdown() -> str:
    lines = ["| profile | engine | precision | GPU holds | CPU holds |", "| --- | --- | --- | --- | --- |"]
    for p in PROFILES.values():
        engine = {"amp": "torch autocast + GradScaler", "fsdp": "torch FSDP2 + CPUOffloadPolicy",
                  "deepspeed": f"DeepSpeed ZeRO-{p.zero_stage}"}[p.engine]
        if p.offload_optimizer and p.is_deepspeed:
            engine += " + offload_optimizer cpu" + (" + offload_param cpu" if p.offload_param else "")
        lines.append(f"| `{p.name}` | {engine} | {p.precision} | {p.gpu_holds} | {p.cpu_holds} |")
    return "\n".join(lines)
