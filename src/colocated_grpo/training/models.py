"""Model resolution and offline model builders. A model config names a hub id or local directory (`build: null`), or
a builder (`build: tiny`, `build: qwen2.5-1.5b`, …) that writes a random-weight model and a locally trained tokenizer
into the directory `name_or_path` once (TRL's colocated vLLM loads the model by that path)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from colocated_grpo.training.data import arithmetic_corpus

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Architecture of a Qwen2 model: enough to build it and to validate a tensor-parallel size against it."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int | None  # None: the size of the locally trained tokenizer
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    dtype: str = "bfloat16"  # of the written weights

    def dimensions(self) -> dict:
        """Qwen2Config's arguments for the layers (the vocabulary is the tokenizer's where `vocab_size` is None)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("vocab_size", "dtype")}


# Real Qwen2.5 shapes (from the published config.json files); throughput depends on shapes, not weights.
# The tiny model keeps head_dim 64: the CPU attention kernel of vLLM rejects head_dim 16.
SHAPES: dict[str, Shape] = {
    "tiny": Shape(128, 256, 2, 2, 2, None, True, 1024, "float32"),
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    # The 0.5B body with the locally trained vocabulary (about 1,000 tokens): a random model that learns a token
    # reward within tens of steps; with 151,936 tokens its policy hardly moves in that time (docs/results.md).
    "qwen2.5-0.5b-body": Shape(896, 4864, 24, 14, 2, None, True),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
}

TOKENIZER_VOCAB = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def resolve(model_cfg) -> str:
    """Return the path or hub id to load, building the model first when the config names a builder."""
    if model_cfg.build:
        return str(build(model_cfg.build, Path(model_cfg.name_or_path).expanduser()))
    return str(model_cfg.name_or_path)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the checks before a run need of a model, read without loading weights; `source` says where from."""

    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int | None
    max_position_embeddings: int | None
    source: str


def architecture(model_cfg, network: bool = False) -> Architecture | None:
    """The model's architecture, from the first of: its config.json (a local directory, a built model that exists, a
    hub id already in the Hugging Face cache), the builder's shape, what the preset declares for its own hub id
    (`published`, ignored once name_or_path names another model), and, with `network`, the hub. None: unknown."""
    if (path := local_config_json(model_cfg)) is not None:
        return _from_config(config_keys(path), str(path))
    if model_cfg.get("build"):
        return _from_config(dataclasses.asdict(SHAPES[model_cfg.build]), "builder shape")
    published = model_cfg.get("published")
    if published and str(published.get("id")) == str(model_cfg.name_or_path):
        return _from_config(published, f"the published config of {published.id} (model.published)")
    if network:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(str(model_cfg.name_or_path), "config.json"))
        return _from_config(config_keys(path), str(path))
    return None


def local_config_json(model_cfg) -> Path | None:
    """config.json of the model where it is on this machine already (a directory, or the Hugging Face cache)."""
    name = str(model_cfg.name_or_path)
    directory = Path(name).expanduser()
    if (directory / "config.json").is_file():
        return directory / "config.json"
    if model_cfg.get("build") or name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def config_keys(path: Path) -> dict:
    """A config.json's keys; a multimodal model's: its language model's (`text_config`)."""
    config = json.loads(path.read_text())
    return config.get("text_config", config)


def _from_config(config, source: str) -> Architecture:
    """The architecture of a config.json's keys (or a preset's `published` ones)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return Architecture(heads, kv_heads, config.get("vocab_size"), config.get("max_position_embeddings"), source)


def parameter_count(path: str | Path) -> int | None:
    """The parameters in a local model directory's safetensors files, read from their headers (no weight loads);
    None when it has none (a hub id, other formats)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    count = 0
    for file in files:
        with safe_open(file, "pt") as weights:
            count += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (no iteration on safe_open)
    return count or None


def build(shape_name: str, target: Path) -> Path:
    """Build a random-weight Qwen2 of the named shape into `target` once; later calls reuse it. Safe under torchrun:
    ranks take a file lock, and the model is built beside the target, then renamed into place."""
    if shape_name not in SHAPES:
        raise ValueError(f"model.build={shape_name!r} is not a known shape; choose one of {sorted(SHAPES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        t0 = time.monotonic()
        log.info("building the random-weight %s model into %s (once; later runs reuse it)", shape_name, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
        try:
            _write_model(SHAPES[shape_name], tmp)
            os.replace(tmp, target)
            log.info("built %s in %.0f s", target, time.monotonic() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_model(shape: Shape, out: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(shape.vocab_size)
    tokenizer.save_pretrained(out)
    dimensions = shape.dimensions()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id  # <|endoftext|> (also the text's start), <|im_end|>
    ids = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    config = Qwen2Config(
        vocab_size=len(tokenizer), **dimensions, **ids, rope_theta=1_000_000.0, torch_dtype=shape.dtype
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, shape.dtype))
    model.generation_config.update(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    (out / "BUILD.json").write_text(json.dumps({"shape": shape.__dict__, "weights": "random (seed 0)"}, indent=2))


def build_tokenizer(vocab_size: int | None = None):
    """A byte-level BPE tokenizer trained on the synthetic arithmetic text, with a Qwen-style chat template; with
    `vocab_size`, padded with filler tokens to exactly that size (a real-shape model may sample any id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(arithmetic_corpus(), trainer=trainer)
    if vocab_size:
        tok = _pad_vocab(tok, vocab_size)
    special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, model_max_length=32768, **special)


def _pad_vocab(tok, vocab_size: int):
    """Rebuild the BPE model with unreachable two/three-character byte-level fillers up to `vocab_size`."""
    from itertools import count, islice, product

    from tokenizers import Tokenizer, models, pre_tokenizers

    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(p) for n in (2, 3) for p in product(alphabet, repeat=n))
    # Special tokens live in the BPE vocab too (ids 0..2); keep ids contiguous.
    next_id = max(vocab.values()) + 1
    new = list(islice((f for f in fillers if f not in vocab), max(0, vocab_size - next_id)))
    vocab.update(zip(new, count(next_id)))
    padded = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    padded.pre_tokenizer = tok.pre_tokenizer
    padded.decoder = tok.decoder
    padded.add_special_tokens(SPECIAL_TOKENS)
    return padded
