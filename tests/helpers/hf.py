"""A tiny Hugging Face model directory made on the spot: a random LlamaConfig model and a word-level
tokenizer trained with the ``tokenizers`` library on a few lines. Nothing is downloaded."""

from __future__ import annotations

import json
import os

WORDS = ("the a cat dog bird fish sat ran flew swam on in under over mat log tree pond red blue green small big "
         "what is color of answer question say hello hi yes no one two three four five six seven eight nine ten "
         "add plus equals capital france paris spain madrid italy rome repeat after me where sky").split()

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(out_dir: str, *, pad: bool = True, chat_template: bool = True):
    """A word-level tokenizer over WORDS plus punctuation, with bos/eos (and pad), saved to ``out_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in WORDS + list(".,?!:;#\n'\"-0123456789"):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    kw = dict(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    if pad:
        kw["pad_token"] = "<pad>"
    fast = PreTrainedTokenizerFast(**kw)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_model_dir(out_dir: str, *, pad: bool = True, chat_template: bool = True, seed: int = 0,
                   hidden: int = 64, layers: int = 2, max_positions: int = 128) -> str:
    """Save a tiny random Llama (fp32) and its tokenizer to ``out_dir``; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir, pad=pad, chat_template=chat_template)
    # intermediate in whole 64-weight blocks, as bitsandbytes' 4-bit CPU layouts want (QLoRA tests)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


# Instruction records the tiny model can learn in a few steps: each answer is fixed by its question.
QA = [("what is the color of the sky ?", "blue ."), ("what is the capital of france ?", "paris ."),
      ("what is the capital of spain ?", "madrid ."), ("what is the capital of italy ?", "rome ."),
      ("add one plus two .", "three ."), ("add two plus two .", "four ."), ("add three plus four .", "seven ."),
      ("say hello .", "hello hello ."), ("repeat after me : red green blue", "red green blue ."),
      ("what is the color of the tree ?", "green ."), ("add four plus five .", "nine ."),
      ("where is the cat ?", "the cat sat on the mat .")]


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path


def qa_records(kind: str = "prompt_response", repeat: int = 4) -> list[dict]:
    out = []
    for _ in range(repeat):
        for q, a in QA:
            if kind == "prompt_response":
                out.append({"prompt": q, "response": a})
            elif kind == "alpaca":
                out.append({"instruction": q, "input": "", "output": a})
            elif kind == "messages":
                out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            else:
                out.append({"text": f"{q} {a}"})
    return out
