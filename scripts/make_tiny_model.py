"""Make a tiny local Hugging Face model directory to try fine-tuning offline (nothing is downloaded).

    python scripts/make_tiny_model.py models/tiny-hf [--data examples/data/*.jsonl]

Writes a randomly initialised Llama-style model (about 1M parameters, fp32 safetensors) and a byte-level
BPE tokenizer trained with the `tokenizers` library on the text of the data files, with a ChatML chat
template, eos `<|im_end|>` and pad `<|endoftext|>`: the same layout as a real model directory, so
`vramfit train ... model.name=models/tiny-hf` and `vramfit export` run exactly as they would on one. The
model starts from random weights: it learns the example data's answers by heart, nothing more.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def strings(obj):
    """Every string inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def corpus(paths: list[str]) -> list[str]:
    sys.path.insert(0, ROOT)
    from launcher.data.formats import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

    texts = [ALPACA_WITH_INPUT, ALPACA_NO_INPUT, "system user assistant"]
    for p in paths:
        with open(p) as fh:
            if p.endswith(".jsonl"):
                for line in fh:
                    if line.strip():
                        texts += list(strings(json.loads(line)))
            elif p.endswith(".json"):
                texts += list(strings(json.load(fh)))
            else:
                texts.append(fh.read())
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write (must not exist)")
    ap.add_argument("--data", nargs="*", default=sorted(glob.glob(os.path.join(ROOT, "examples", "data", "*"))),
                    help="files whose text trains the tokenizer (default: examples/data/*)")
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if os.path.exists(args.out):
        print(f"{args.out} already exists; choose another directory", file=sys.stderr)
        return 2

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(args.data), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    # Every linear dimension in whole 64-weight blocks, as bitsandbytes' 4-bit CPU kernels want (QLoRA).
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out)
    fast.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: random Llama, {n / 1e6:.2f}M parameters, BPE tokenizer of {len(fast)} tokens "
          f"trained on {len(args.data)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
