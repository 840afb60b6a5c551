"""A damaged model folder (truncated weights, a config transformers
refuses), a tokenizer of another model or a missing converter is one error
naming the file or the fix,
from Python and from the command line, not a traceback from a library."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from rollout_engine import RolloutEngine
from rollout_engine import model_zoo
from rollout_engine.cli import main as cli_main
from tests.models import make_hf_model


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("good"))
    make_hf_model("llama").save_pretrained(folder)
    return folder


def _copy(good_folder, tmp_path) -> str:
    folder = str(tmp_path / "model")
    shutil.copytree(good_folder, folder)
    return folder


@pytest.mark.parametrize("keep_bytes", [1000, None], ids=["header-cut", "data-cut"])
def test_truncated_weights_name_the_file(good_folder, tmp_path, capsys, keep_bytes):
    folder = _copy(good_folder, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(keep_bytes if keep_bytes is not None else size - 4096)
    with pytest.raises(OSError, match="model.safetensors: not a readable safetensors file .*download or convert"):
        RolloutEngine(folder, device="cpu")
    assert cli_main(["generate", "--model", folder, "--input-ids", "1,2,3", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors: not a readable safetensors file" in err[0], err


def test_a_config_transformers_refuses_names_the_config(good_folder, tmp_path, capsys):
    folder = _copy(good_folder, tmp_path)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=65, num_attention_heads=4)  # heads do not divide the width
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="config.json: transformers refuses this config .*hidden size") as exc:
        RolloutEngine(folder, device="cpu")
    assert "\n" not in str(exc.value)
    assert cli_main(["generate", "--model", folder, "--input-ids", "1,2,3", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json" in err[0] and "--help" not in err[0], err  # no flag to look up


def test_a_config_without_the_model_sizes_names_them(good_folder, tmp_path):
    """Left out, transformers would take its class's defaults (Llama's 32,000
    tokens, 32 layers) and the weights be refused for a tensor's shape."""
    folder = _copy(good_folder, tmp_path)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    del cfg["vocab_size"], cfg["num_hidden_layers"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"config.json: no vocab_size, num_hidden_layers \(transformers would take"):
        RolloutEngine(folder, device="cpu")


def test_a_model_type_transformers_does_not_know_names_the_config(good_folder, tmp_path):
    folder = _copy(good_folder, tmp_path)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["model_type"] = "not-a-model-type"
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"config.json: transformers refuses this config \(.*not-a-model-type"):
        RolloutEngine(folder, device="cpu")


def test_a_zoo_model_without_the_converter_says_how_to_install_it(tmp_path, monkeypatch):
    """Found before the download: the 'convert' extra names what to install."""
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path / "cache"))
    real = model_zoo.importlib.util.find_spec
    monkeypatch.setattr(model_zoo.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    monkeypatch.setattr(model_zoo.subprocess, "run", lambda *a, **k: pytest.fail("downloaded before the check"))
    with pytest.raises(RuntimeError, match=r"needs gguf: pip install gguf accelerate \(the 'convert' extra"):
        model_zoo.ensure_model("smollm2-135m", quiet=True)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_weights_load(good_folder, smollm2_dir, capsys,
                                                                                   monkeypatch):
    """SmolLM2's 49,152 tokens against a 512-token model: another model's tokenizer."""
    from rollout_engine.core import build

    monkeypatch.setattr(build, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match=r"^tokenizer '.*' has 49152 tokens, more than the model's "
                                         r"vocabulary of 512: it belongs to another model"):
        RolloutEngine(good_folder, tokenizer=smollm2_dir, device="cpu")
    assert cli_main(["generate", "--model", good_folder, "--tokenizer", smollm2_dir, "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --tokenizer: '" in err[0] and "49152 tokens" in err[0], err


@pytest.mark.parametrize("free_gib,words", [
    (20.0, "free before the weights loaded: 20.0 of the GPU's 140.0 GiB; this process (a trainer's tensors, an "
           "engine not shut down) or another one holds the rest; the weights take 15.0 GiB"),
    (139.0, "free before the weights loaded: 139.0 of the GPU's 140.0 GiB; the weights take 150.0 GiB"),
])
def test_too_little_room_for_the_kv_cache_says_where_the_memory_is(monkeypatch, free_gib, words):
    """Memory another holder keeps is named as such; a model too large is not blamed on one."""
    import torch

    from rollout_engine.config import EngineConfig
    from rollout_engine.kv_sizing import kv_capacity_tokens
    from rollout_engine.models.config import ModelConfig
    from rollout_engine.models.presets import preset_config

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * gib), 140 * gib))
    mc = ModelConfig.from_hf(preset_config("qwen2.5-7b"))
    weights = (15 if free_gib < 100 else 150) * gib
    with pytest.raises(ValueError, match="leaves room for only 0 KV tokens") as exc:
        kv_capacity_tokens(EngineConfig(model="qwen2.5-7b"), mc, 57344, torch.device("cuda"), int(free_gib * gib),
                           weights, 2)
    assert words in str(exc.value), exc.value


def test_a_few_tokens_past_the_vocabulary_are_a_warning_not_a_refusal(caplog):
    """A pad token added after training without resizing: the model's own tokenizer still."""
    import logging

    from rollout_engine.tokenizer import check_tokenizer_fits

    class Tok:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        check_tokenizer_fits(Tok(32001), 32000, None)
        check_tokenizer_fits(Tok(151665), 151936, None)  # fewer: embeddings padded past the tokens
    assert [r.getMessage() for r in caplog.records] == [
        "the model folder's tokenizer has 32001 tokens, 1 more than the model's vocabulary of 32000 (added without "
        "resizing the embeddings?): requests with those ids are refused"]
    with pytest.raises(ValueError, match="has 151665 tokens, more than the model's vocabulary of 49152"):
        check_tokenizer_fits(Tok(151665), 49152, "qwen-tok")


def test_a_text_prompt_with_ids_past_the_vocabulary_is_refused_by_name(smollm2_dir, tmp_path, caplog):
    """A tokenizer 52 tokens past the model's vocabulary is let through with a
    warning; a text prompt that encodes to one of those ids is then refused,
    not run into an index error (on a GPU, a device-side assert)."""
    import logging

    from rollout_engine import SamplingParams

    folder = str(tmp_path / "m")
    make_hf_model("llama", vocab_size=49100).save_pretrained(folder)
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        engine = RolloutEngine(folder, tokenizer=smollm2_dir, device="cpu", max_total_tokens=512)
    try:
        assert any("52 more than the model's vocabulary of 49100" in r.getMessage() for r in caplog.records)
        past = next(t for t in range(49100, 49152) if engine.tokenizer.encode(engine.tokenizer.decode([t])) == [t])
        text = engine.tokenizer.decode([past])
        params = SamplingParams(max_new_tokens=2, temperature=0)
        with pytest.raises(ValueError, match=rf"request 1: prompts encodes to token ids past the model's vocabulary "
                                             rf"\[0, 49100\): \[{past}\]"):
            engine.generate(["hello", text], sampling_params=params)
        assert len(engine.generate(["hello"], sampling_params=params)[0].output_token_ids) == 2  # still usable
    finally:
        engine.shutdown()


@pytest.mark.parametrize("damage", ["garbage tokenizer.json", "broken tokenizer_config.json"])
def test_damaged_tokenizer_files_name_the_folder(smollm2_dir, tmp_path, capsys, damage):
    folder = str(tmp_path / "model")
    shutil.copytree(smollm2_dir, folder)
    if damage == "garbage tokenizer.json":
        with open(os.path.join(folder, "tokenizer.json"), "wb") as f:
            f.write(bytes(range(128, 256)) * 64)
    else:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write('{"model_max_length": 8192,,}')
    with pytest.raises(OSError, match=f"{folder}: its tokenizer files cannot be read"):
        RolloutEngine(folder, device="cpu")
    assert cli_main(["generate", "--model", folder, "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its tokenizer files cannot be read" in err[0], err


def test_a_chat_prompt_past_the_vocabulary_is_named_as_the_prompt(smollm2_dir, tmp_path, capsys):
    """--chat turns text into ids: the refusal names the prompt, not --input-ids the user never gave."""
    folder = str(tmp_path / "m")
    make_hf_model("llama", vocab_size=49100).save_pretrained(folder)
    from rollout_engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir, None)
    past = next(t for t in range(49100, 49152) if tok.encode(tok.decode([t])) == [t])
    capsys.readouterr()  # the model's saving
    assert cli_main(["generate", "--model", folder, "--tokenizer", smollm2_dir, "--chat", "--max-total-tokens",
                     "512", "hi", tok.decode([past])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollout-engine: error: argument --chat: prompt 1 encodes to token "
                                               f"ids past the model's vocabulary [0, 49100): [{past}]"), err
