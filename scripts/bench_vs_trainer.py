#!/usr/bin/env python
"""vramfit against the HF Trainer + DeepSpeed at the same profile, model directory, data and measure.

    python scripts/bench_vs_trainer.py [--model tiny|20m] [--steps 40] [--repeats 3] [--json OUT]
    python scripts/bench_vs_trainer.py --steps 3 --repeats 1 --seq-len 32 --no-same-ds --work DIR  # a quick check

The model is a Qwen2 made from a config (random weights, never downloaded) and saved as a model directory
with a byte-level BPE tokenizer trained here on the repository's own manuals (docs/*.md, README.md), which
are also the text both train on: paragraphs packed into ``--seq-len`` blocks by vramfit's data reader, the
same blocks handed to the Trainer. ``tiny``: hidden 64, 2 layers; ``20m``: hidden 512, 6 layers (about 21M
parameters). Profile ``zero2-bf16`` on the CPU, micro-batch 2, global batch 4 (accumulation 2), AdamW
lr 3e-4, clipping 1.0, no checkpointing, no eval, no saving.

Measure, for both: the tokens of steps 3..N over their wall time (from the end of step 2 to the end of step N;
vramfit: ``time_s`` of metrics.jsonl; the Trainer: a callback's clock at ``on_step_end``). Every run is its own
process; the runs alternate (vramfit, Trainer, Trainer with vramfit's buckets, vramfit, ...) so that a load
change hits all alike, and the ratio is taken per round. Two Trainer variants:

- ``trainer``: the profile's JSON (ds_configs/zero2-bf16.json) as a Trainer user would pass it; the Trainer fills
  its "auto" values, the reduce bucket as hidden_size**2 (its rule; allgather_bucket_size, which it does not
  fill, is left to DeepSpeed's default);
- ``trainer_same_ds``: the ds_config.json vramfit's run resolved and wrote (its bucket sizes included), so the
  DeepSpeed settings are identical and only the loops differ (``--no-same-ds``: not run, one process less a round).

Both step with torch's fused AdamW (vramfit passes it to DeepSpeed; the Trainer builds its default
``adamw_torch_fused`` when the JSON has no optimizer section). The load average is printed with every run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "20m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2),
}
VOCAB = 4096
PROFILE = "zero2-bf16"
LR = 3e-4


def prepare(kind: str, work: str, seq_len: int) -> tuple[str, str]:
    """(model directory, text file): made once per kind under ``work``."""
    model_dir, text = os.path.join(work, f"qwen2-{kind}"), os.path.join(work, "text.txt")
    if not os.path.exists(text):
        parts = []
        for path in sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)) + [
                os.path.join(ROOT, "README.md")]:
            parts += [p.strip() for p in open(path, encoding="utf-8").read().split("\n\n") if p.strip()]
        with open(text, "w", encoding="utf-8") as fh:
            fh.write("\n\n".join(parts * 4) + "\n")  # four passes: enough blocks for any run here
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train([text], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>", "<pad>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
        cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=max(512, seq_len), tie_word_embeddings=False,
                          eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, **MODELS[kind])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
        fast.save_pretrained(model_dir)
    return model_dir, text


def overrides(model_dir: str, text: str, steps: int, seq_len: int, out: str, name: str) -> list[str]:
    return [f"model.name={model_dir}", f"data.source={text}", f"data.seq_len={seq_len}", f"profile={PROFILE}",
            "train.micro_batch_size=2", "train.global_batch_size=4", f"train.max_steps={steps}",
            "train.warmup_steps=2", f"train.lr={LR}", "model.gradient_checkpointing=false", "checkpoint.save=false",
            "sample_tokens=0", "log.progress=off", "log.every_steps=1000", f"output_dir={out}", f"run_name={name}",
            "train.oom_fallback=false"]


def tokens_per_s(times: list[float], tokens_per_step: int) -> float:
    """Steps 3..N over their wall time: ``times[i]`` is the clock at the end of step i + 1."""
    return (len(times) - 2) * tokens_per_step / (times[-1] - times[1])


def run_vramfit(model_dir, text, steps, seq_len, out, name) -> dict:
    cmd = [sys.executable, "-m", "launcher", "train", *overrides(model_dir, text, steps, seq_len, out, name)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"vramfit failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in open(os.path.join(out, name, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, name, "summary.json")))
    return {"tokens_per_s": tokens_per_s([r["time_s"] for r in rows], 4 * seq_len),
            "final_loss": rows[-1]["loss"], "threads": summary.get("threads"), "optimizer": summary.get("optimizer"),
            "ds_config": os.path.join(out, name, "ds_config.json")}


def trainer_worker(a) -> int:
    """One HF Trainer run (in its own process): prints a JSON line with its tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from launcher.config.load import load_config
    from launcher.data import load_data
    from launcher.machine.deepspeed_ops import use_env_ninja
    from launcher.machine.threads import apply, decide

    use_env_ninja()  # the shared-memory comm op as vramfit's runs built it (another ninja would rebuild it)

    cfg = load_config(None, overrides(a.model_dir, a.text, a.steps, a.seq_len, a.out, "hf-data"))
    apply(decide(a.threads if a.threads else "auto"))  # the threads vramfit's run takes, measured the same way
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    data = load_data(cfg, len(tok), tok)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            b = data.batch([i])
            return {"input_ids": b["input_ids"][0], "labels": b["labels"][0]}

    clock: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.append(time.perf_counter())

    ds = json.load(open(a.ds_config))
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16)
    args = TrainingArguments(output_dir=os.path.join(a.out, "hf"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=a.steps, learning_rate=LR, warmup_steps=2,
                             lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.0, adam_beta1=0.9,
                             adam_beta2=0.95, bf16=True, deepspeed=ds, logging_steps=1000, save_strategy="no",
                             report_to=[], dataloader_num_workers=0, use_cpu=True, seed=1234, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[Clock()])
    trainer.train()
    opt = trainer.optimizer
    print("RESULT " + json.dumps({"tokens_per_s": tokens_per_s(clock, 4 * a.seq_len),
                                  "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
                                  "threads": torch.get_num_threads(),
                                  "step_s": [round(b - a, 4) for a, b in zip(clock, clock[1:])]}), flush=True)
    return 0


def run_trainer(model_dir, text, steps, seq_len, out, ds_config, threads) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--trainer-worker", "--model-dir", model_dir, "--text", text,
           "--steps", str(steps), "--seq-len", str(seq_len), "--out", out, "--ds-config", ds_config,
           "--threads", str(threads or 0)]
    import socket

    with socket.socket() as sock:  # one process group of one, as vramfit makes for DeepSpeed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, ACCELERATE_USE_DEEPSPEED="true", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"Trainer failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "vramfit-bench-vs-trainer"))
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-same-ds", action="store_true",
                    help="leave out the Trainer run with vramfit's resolved ds_config.json (trainer_same_ds)")
    ap.add_argument("--trainer-worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("--model-dir", "--text", "--out", "--ds-config"):
        ap.add_argument(k, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer_worker:
        return trainer_worker(a)
    os.makedirs(a.work, exist_ok=True)
    model_dir, text = prepare(a.model, a.work, a.seq_len)
    rounds = []
    with tempfile.TemporaryDirectory() as out:
        # The profile's JSON as a Trainer user passes it. The Trainer fills every "auto" but
        # allgather_bucket_size (Accelerate refuses that one): it is left out, so DeepSpeed's default applies.
        profile = json.load(open(os.path.join(ROOT, "ds_configs", f"{PROFILE}.json")))
        profile["zero_optimization"].pop("allgather_bucket_size", None)
        profile_json = os.path.join(out, f"{PROFILE}-trainer.json")
        json.dump(profile, open(profile_json, "w"), indent=2)
        for i in range(a.repeats):
            load = os.getloadavg()[0]
            v = run_vramfit(model_dir, text, a.steps, a.seq_len, out, f"v{i}")
            t = run_trainer(model_dir, text, a.steps, a.seq_len, out, profile_json, v["threads"]["intra_op"])
            same = (None if a.no_same_ds else
                    run_trainer(model_dir, text, a.steps, a.seq_len, out, v["ds_config"], v["threads"]["intra_op"]))
            r = {"load_average": load, "vramfit": v["tokens_per_s"], "trainer": t["tokens_per_s"],
                 "trainer_same_ds": same and same["tokens_per_s"], "vs_trainer": v["tokens_per_s"] / t["tokens_per_s"],
                 "vs_trainer_same_ds": same and v["tokens_per_s"] / same["tokens_per_s"],
                 "vramfit_optimizer": v["optimizer"], "trainer_optimizer": t["optimizer"],
                 "threads": v["threads"]["intra_op"], "vramfit_final_loss": v["final_loss"]}
            rounds.append(r)
            same_text = ("" if same is None else f", Trainer with vramfit's ds_config {r['trainer_same_ds']:.0f} "
                                                  f"({r['vs_trainer_same_ds']:.3f}x)")
            print(f"round {i + 1} (load {load:.2f}): vramfit {r['vramfit']:.0f} tok/s, Trainer {r['trainer']:.0f} "
                  f"({r['vs_trainer']:.3f}x){same_text}; threads {r['threads']}", flush=True)
    med = {k: None if rounds[0][k] is None else statistics.median(r[k] for r in rounds)
           for k in ("vs_trainer", "vs_trainer_same_ds")}
    result = {"model": a.model, "params": MODELS[a.model], "profile": PROFILE, "steps": a.steps,
              "seq_len": a.seq_len, "micro_batch": 2, "global_batch": 4, "rounds": rounds,
              "median_vs_trainer": med["vs_trainer"], "median_vs_trainer_same_ds": med["vs_trainer_same_ds"],
              "load_average_end": os.getloadavg()[0]}
    print(f"\nmedian ratio vramfit / Trainer: {med['vs_trainer']:.3f} (target >= 1.05)"
          + ("" if med["vs_trainer_same_ds"] is None else
             f"; with identical DeepSpeed settings: {med['vs_trainer_same_ds']:.3f}"))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
