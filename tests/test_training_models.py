import json
import threading

import pytest
from omegaconf import OmegaConf

from colocated_grpo.training import models


def test_tiny_model_is_built_once_and_reused(tmp_path):
    target = tmp_path / "tiny"
    assert models.build("tiny", target) == target
    config = json.loads((target / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # head_dim vLLM's CPU kernel accepts
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    models.build("tiny", target)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_concurrent_builds_do_not_collide(tmp_path):
    target, errors = tmp_path / "tiny", []

    def build():
        try:
            models.build("tiny", target)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and (target / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_tiny_tokenizer_round_trips_and_has_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.build("tiny", tmp_path / "tiny"))
    text = "What is 12 + 30? \\boxed{42} ünïcode"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 1?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_padded_vocabulary_has_exact_size_and_every_id_decodes():
    tok = models.build_tokenizer(vocab_size=5000)
    assert len(tok) == 5000
    assert isinstance(tok.decode(list(range(5000))), str)
    assert tok.decode(tok.encode("7 * 6 = 42")) == "7 * 6 = 42"


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"])
def test_real_qwen_shapes(name):
    shape = models.SHAPES[name]
    assert shape.vocab_size in (151936, 152064)
    assert shape.hidden_size % shape.num_attention_heads == 0
    assert shape.hidden_size // shape.num_attention_heads == 128 if name != "qwen2.5-0.5b" else 64


def test_architecture_comes_from_config_json_shape_or_declaration(tmp_path):
    arch = models.architecture(OmegaConf.create({"name_or_path": str(tmp_path / "none"), "build": "qwen2.5-7b"}))
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.vocab_size) == (28, 4, 152064)
    published = {"id": "Qwen/Qwen2.5-1.5B-Instruct", "num_attention_heads": 12, "num_key_value_heads": 2}
    preset = OmegaConf.create({"name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "build": None, "published": published})
    arch = models.architecture(preset, network=True)
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (12, 2)
    # Another model in name_or_path: the preset's declaration says nothing about it; its own config.json counts.
    path = models.build("tiny", tmp_path / "tiny")
    preset.name_or_path = str(path)
    arch = models.architecture(preset)
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (2, 2) and arch.source == str(path / "config.json")
    assert arch.vocab_size == json.loads((path / "config.json").read_text())["vocab_size"]
    assert models.architecture(OmegaConf.create({"name_or_path": "nobody/nothing", "build": None})) is None
