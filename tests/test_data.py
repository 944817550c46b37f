"""Local data files through `datasets`: every format, prompt masking, packing, and every bad input as a
clear ConfigError raised before the run directory is made."""

import json
import os

import pytest

from helpers.hf import make_model_dir, qa_records, write_jsonl
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.data import load_data
from launcher.model.build import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_hf")))


def cfg_for(model_dir, source, *overrides):
    return load_config(None, [f"model.name={model_dir}", f"data.source={source}", "data.seq_len=32", *overrides])


def load(model_dir, source, *overrides):
    cfg = cfg_for(model_dir, source, *overrides)
    tok = load_tokenizer(cfg)
    return load_data(cfg, 10_000, tok), tok


def trained_text(tok, data, row=0):
    ids, labels = data.input_ids[row], data.labels[row]
    return tok.decode(ids[labels != -100].tolist()), tok.decode(ids[labels == -100].tolist(), skip_special_tokens=True)


def test_jsonl_prompt_response_masks_the_prompt(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), [{"prompt": "what is the capital of france ?", "response": "paris ."}])
    data, tok = load(model_dir, src)
    assert data.input_ids.shape == (1, 32)
    trained, masked = trained_text(tok, data)
    assert trained == "paris . <eos>"  # the response and eos are in the loss
    assert masked.startswith("what is the capital of france ?")  # prompt and padding are not
    assert "prompt_response" in data.description and "prompt tokens masked" in data.description


def test_json_array_alpaca(model_dir, tmp_path):
    src = tmp_path / "d.json"
    src.write_text(json.dumps(qa_records("alpaca", repeat=1)[:3]))
    data, tok = load(model_dir, str(src), "data.seq_len=64")
    assert len(data) == 3 and "alpaca" in data.description
    trained, _ = trained_text(tok, data)
    assert trained == "blue . <eos>"
    # the Alpaca template is there (its words map to <unk> in this tiny vocabulary, but its layout survives)
    assert "# # # <unk> : what is the color" in tok.decode(data.input_ids[0].tolist())


def test_csv_with_custom_fields(model_dir, tmp_path):
    src = tmp_path / "d.csv"
    src.write_text("question,answer\nwhat is the capital of spain ?,madrid .\nsay hello .,hello .\n")
    data, tok = load(model_dir, str(src), "data.prompt_field=question", "data.response_field=answer")
    assert len(data) == 2 and trained_text(tok, data, 0)[0] == "madrid . <eos>"


def test_parquet_text_packed(model_dir, tmp_path):
    import pandas as pd

    src = str(tmp_path / "d.parquet")
    pd.DataFrame({"text": ["the cat sat on the mat ."] * 20}).to_parquet(src)
    data, tok = load(model_dir, src)
    # 20 records x (bos + 7 words + eos) = 180 tokens -> 5 full blocks of 32, the short tail dropped
    assert data.input_ids.shape == (5, 32) and bool((data.labels == data.input_ids).all())
    assert "packed" in data.description


def test_txt_paragraphs_unpacked_pad_is_masked(model_dir, tmp_path):
    src = tmp_path / "d.txt"
    src.write_text("the cat sat on the mat .\nthe dog ran .\n\na red bird flew over the tree .\n\n\n")
    data, tok = load(model_dir, str(src), "data.packing=false")
    assert len(data) == 2  # two paragraphs (blank lines separate records)
    assert tok.decode(data.input_ids[0][data.labels[0] != -100].tolist()) == \
        "<bos> the cat sat on the mat . the dog ran . <eos>"
    assert bool((data.input_ids[0][data.labels[0] == -100] == tok.pad_token_id).all())


def test_messages_with_chat_template_train_assistant_turns_only(model_dir, tmp_path):
    chat = [{"role": "system", "content": "say yes"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yes ."}, {"role": "user", "content": "the cat ?"},
            {"role": "assistant", "content": "the cat sat ."}]
    src = write_jsonl(str(tmp_path / "d.jsonl"), [{"messages": chat}])
    data, tok = load(model_dir, src, "data.seq_len=64")
    trained, masked = trained_text(tok, data)
    assert trained == "yes . <eos> the cat sat . <eos>"  # both replies, each with the template's end token
    assert "hi" in masked and "say yes" in masked and "<|assistant|>" not in trained


def test_messages_without_chat_template(tmp_path, vramfit_log):
    d = make_model_dir(str(tmp_path / "m"), chat_template=False)
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records("messages", repeat=1)[:2])
    data, tok = load(d, src)
    assert trained_text(tok, data)[0] == "blue . <eos>"
    assert "no chat template" in vramfit_log.text


def test_tokenizer_without_pad_uses_eos_and_says_so(tmp_path, vramfit_log):
    d = make_model_dir(str(tmp_path / "m"), pad=False)
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1)[:2])
    data, tok = load(d, src)
    assert tok.pad_token == tok.eos_token and "no pad token: padding with eos" in vramfit_log.text
    assert int(data.input_ids[0, -1]) == tok.eos_token_id and int(data.labels[0, -1]) == -100


# ---- bad input: one ConfigError each, naming the file/line/field and the fix


def problem(model_dir, source, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load(model_dir, source, *overrides)
    assert len(e.value.problems) == 1
    return e.value.problems[0]


def test_missing_path(model_dir, tmp_path):
    p = problem(model_dir, str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl' not found" in p and "fix: check the path" in p


def test_bad_jsonl_line_is_named(model_dir, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": "b"}\n{"prompt": "a" "response"}\n')
    p = problem(model_dir, str(src))
    assert "line 3:" in p and "fix: correct that line" in p


def test_bad_json_array_line_is_named(model_dir, tmp_path):
    src = tmp_path / "d.json"
    src.write_text('[\n{"text": "a"},\n{"text": "b",}\n]\n')
    assert "line 3:" in problem(model_dir, str(src))


def test_records_without_expected_fields_list_what_was_found(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), [{"question": "q", "answer": "a"}])
    p = problem(model_dir, src)
    assert "['question', 'answer']" in p and "data.prompt_field" in p and "fix:" in p
    p = problem(model_dir, src, "data.format=alpaca")
    assert "needs ['instruction', 'output']" in p and "['question', 'answer']" in p


def test_empty_after_filtering(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), [{"prompt": "q", "response": ""}, {"prompt": "q", "response": None}])
    p = problem(model_dir, src)
    assert "empty after filtering" in p and "2 skipped" in p
    long = write_jsonl(str(tmp_path / "long.jsonl"), [{"prompt": "the " * 40, "response": "yes"}])
    assert "empty after filtering" in problem(model_dir, long)


def test_unknown_extension_and_directory(model_dir, tmp_path):
    (tmp_path / "d.xml").write_text("<a/>")
    assert "'.xml'" in problem(model_dir, str(tmp_path / "d.xml"))
    # a folder is a source of shards now (issue 17); one without data files says so
    assert "holds no data files" in problem(model_dir, str(tmp_path))


def test_preset_without_tokenizer_and_file_data(tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    with pytest.raises(ConfigError, match="needs a tokenizer, and model.name='tiny' has none"):
        load("tiny", src)


def test_tokenizer_bigger_than_the_model(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    cfg = cfg_for(model_dir, src)
    with pytest.raises(ConfigError, match="embeds only 20 ids"):
        load_data(cfg, 20, load_tokenizer(cfg))


def test_lora_targets_that_match_nothing_list_the_linear_layers(model_dir):
    from launcher.model import lora
    from launcher.model.build import model_config

    cfg = load_config(None, [f"model.name={model_dir}", "lora.r=4", "lora.target_modules=q_proj,qkv,attn"])
    with pytest.raises(ConfigError) as e:
        lora.check(cfg, model_config(cfg))
    (p,) = e.value.problems
    assert "'qkv', 'attn' match no linear layer" in p
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head" in p
    cfg = load_config(None, [f"model.name={model_dir}", "lora.r=4"])
    assert lora.check(cfg, model_config(cfg)) == (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"], [])  # all-linear: the head is left out; no experts


@pytest.mark.parametrize("bad", ["missing", "badline", "seq_len", "targets"])
def test_bad_input_stops_before_the_run_directory(model_dir, tmp_path, bad):
    """Through train(): the error comes before anything is written to output_dir/run_name."""
    from launcher.training.loop import train

    good = write_jsonl(str(tmp_path / "good.jsonl"), qa_records(repeat=1))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    src = {"missing": str(tmp_path / "nope.jsonl"), "badline": str(tmp_path / "bad.jsonl")}.get(bad, good)
    extra = {"seq_len": ["data.seq_len=512"], "targets": ["lora.r=4", "lora.target_modules=nothing"]}.get(bad, [])
    cfg = load_config(None, [f"model.name={model_dir}", f"data.source={src}", "data.seq_len=32", "device=cpu",
                             "engine=amp", f"output_dir={tmp_path / 'runs'}", "run_name=r", *extra])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    want = {"missing": "not found", "badline": "line 2:", "seq_len": "maximum of 128 positions",
            "targets": "'nothing' matches no linear layer"}[bad]
    assert want in str(e.value)
    assert not os.path.exists(tmp_path / "runs" / "r")


def test_sample_prompt_comes_from_the_data(model_dir, tmp_path):
    from launcher.training import generate

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    data, tok = load(model_dir, src)
    cfg = cfg_for(model_dir, src)
    ids = generate.prompt_ids(cfg, tok, data)
    assert tok.decode(ids, skip_special_tokens=True) == "what is the color of the sky ?"
    text, _ = load(model_dir, src, "data.format=text", "data.text_field=prompt")
    assert len(generate.prompt_ids(cfg, tok, text)) == generate.TEXT_PROMPT_TOKENS
    preset = load_config(None, ["sample_prompt=hello there"])
    with pytest.raises(ConfigError, match="is token ids"):
        generate.prompt_ids(preset, None, None)
    assert generate.prompt_ids(load_config(None, ["sample_prompt=5 17 42"]), None, None) == [5, 17, 42]
    assert generate.prompt_ids(load_config(None, ["sample_tokens=0"]), tok, data) is None
    assert ids and all(isinstance(i, int) for i in ids)  # token ids the sample can feed to the model


@pytest.mark.parametrize("name,fmt", [("alpaca-mini.jsonl", "alpaca"), ("chat-mini.jsonl", "messages")])
def test_shipped_example_data_loads(model_dir, name, fmt):
    from helpers import ROOT

    data, _ = load(model_dir, os.path.join(ROOT, "examples", "data", name), "data.seq_len=128")
    assert f"{fmt} records" in data.description and "skipped" not in data.description and len(data) >= 20


def test_json_object_wrapper_and_empty_file(model_dir, tmp_path):
    src = tmp_path / "d.json"
    src.write_text(json.dumps({"version": 1, "data": qa_records(repeat=1)}, indent=2))
    p = problem(model_dir, str(src))
    assert "holds one JSON object" in p and "the list under 'data'" in p
    (tmp_path / "e.jsonl").write_text("\n")
    assert "holds no records" in problem(model_dir, str(tmp_path / "e.jsonl"))
