"""Keep credentials out of everything a run writes (config.yaml, run.json, W&B config, Hydra's .hydra/ files): a
value under a key that names a credential (`api_key`, `hub_token`, `password`, ...) is replaced, and so is any
occurrence of a credential-like environment variable's value (WANDB_API_KEY, HF_TOKEN, ...), e.g. in a command line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from colocated_grpo.run_files import write_text

REDACTED = "<redacted>"

# A key is a credential when its last component is one of these or ends with one of them after "_".
_SECRET_KEY = re.compile(r"(?i)(?:^|[_.])(api_?key|token|secret|password|passwd|credentials?)$")
# Names like `pad_token` / `eos_token` / `max_tokens` are tokenizer settings, not credentials.
_NOT_SECRET_KEY = re.compile(r"(?i)(pad|eos|bos|unk|sep|cls|mask|chat|special|image|video|audio)_token$")
_SECRET_ENV = re.compile(r"(?i)(api_?key|token|secret|password|passwd)")
_EMPTY = ("null", "None", "~", "''", '""')
_MIN_SECRET_LEN = 8  # shorter env values (flags like "1") would redact innocent text
# key=value / key: value where the key ends like a credential (Hydra overrides, YAML lines; in
# `override_dirname: +logger.api_key=…` the second key's value goes, not the whole line)
_ASSIGNMENT = re.compile(
    r"(?im)(^|[\s\"'\[,+~])([\w.\-]*(?:api_?key|token|secret|password|passwd|credentials?))(\s*[=:]\s*)([^\s,\]\"']+)"
)


def is_secret_key(key: str) -> bool:
    key = str(key)
    return bool(_SECRET_KEY.search(key)) and not _NOT_SECRET_KEY.search(key)


def secret_values() -> list[str]:
    """Values of credential-like environment variables (WANDB_API_KEY, HF_TOKEN, ...), longest first."""
    values = {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    for value in secret_values() if secrets is None else secrets:
        text = text.replace(value, REDACTED)

    def kept_or_redacted(m: re.Match) -> str:
        before, key, sep, value = m.groups()
        return m[0] if not is_secret_key(key) or value in _EMPTY else f"{before}{key}{sep}{REDACTED}"

    return _ASSIGNMENT.sub(kept_or_redacted, text)


def redact(obj, secrets: list[str] | None = None):
    """A copy of a JSON-like structure with credential keys and credential values replaced."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(obj, dict):
        return {k: REDACTED if is_secret_key(k) and v not in (None, "") else redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    return obj


def scrub_files(directory: Path) -> None:
    """Redact YAML files already written by others (Hydra's .hydra/ config, overrides and hydra.yaml)."""
    secrets = secret_values()
    for path in Path(directory).glob("*.yaml"):
        text = path.read_text()
        if (clean := redact_text(text, secrets)) != text:
            write_text(path, clean)
