"""Length profiles (`run.length_profile`) for benchmarks with random weights. A random model samples EOS about once in
`vocab_size` tokens, so every completion runs to trainer.max_completion_length, and a benchmark never meets the
padding and the long tail of a training run's lengths. A profile makes completions stop at EOS with a set chance per
token through vLLM's request alone (`SamplingParams.min_tokens` and a `logit_bias` on the model's EOS token, handed
over in GRPOConfig.generation_kwargs), so plain TRL given the same workload sends the same request.

The chance holds where every other token is about as likely as EOS, as with random weights: a trained model's own
EOS probability adds to it. vLLM adds the bias before dividing by the temperature, so the bias is scaled by it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

log = logging.getLogger(__name__)

# name: (the share of the cap every completion runs at least, the share of completions that reach the cap). In between
# each token is EOS with the same chance, so lengths spread geometrically from the floor to the cap.
PROFILES = {
    "short": (1 / 16, 0.001),  # mean ~20 % of the cap; hardly any at it
    "realistic": (1 / 8, 0.05),  # mean ~40 % of the cap, median ~33 %, 5 % cut at the cap
    "long": (1 / 4, 0.3),  # mean ~70 % of the cap
}


@dataclasses.dataclass(frozen=True)
class LengthProfile:
    name: str
    eos_token_id: int
    max_completion_length: int
    min_tokens: int  # EOS is not sampled before this many tokens
    stop_chance: float  # the chance of EOS at each later token
    logit_bias: float  # added to EOS's logit: that chance, with every other token as likely

    def generation_kwargs(self) -> dict:
        return {"min_tokens": self.min_tokens, "logit_bias": {self.eos_token_id: self.logit_bias}}

    def quantile(self, q: float) -> int:
        """The length (EOS counted) that a share `q` of completions do not exceed."""
        after = math.ceil(math.log1p(-q) / math.log1p(-self.stop_chance))
        return min(self.min_tokens + max(after, 1), self.max_completion_length)

    def expected(self) -> dict[str, float]:
        """What the metrics of TRL and ours (completions/…) should read, on average."""
        tokens = self.max_completion_length - self.min_tokens
        at_cap = (1 - self.stop_chance) ** tokens
        return {
            "mean_length": self.min_tokens + (1 - at_cap) / self.stop_chance,
            "p50_length": self.quantile(0.5),
            "p99_length": self.quantile(0.99),
            "clipped_ratio": at_cap,
        }

    def record(self) -> dict:
        """run.json's `length_profile`."""
        return {**dataclasses.asdict(self), "expected": self.expected()}

    def line(self) -> str:
        e, every = self.expected(), 1 / self.stop_chance
        return (
            f"length profile {self.name}: at least {self.min_tokens} tokens, then EOS (id {self.eos_token_id}, logit "
            f"{self.logit_bias:+.2f}) with a chance of 1 in {every:.0f} a token: ~{e['mean_length']:.0f} tokens on "
            f"average, median {e['p50_length']}, p99 {e['p99_length']}, {e['clipped_ratio']:.1%} at the cap of "
            f"{self.max_completion_length}"
        )


def floor_and_chance(name: str, cap: int) -> tuple[int, float]:
    """Profile `name` for completions of at most `cap` tokens: the tokens every completion runs at least, and the
    chance of EOS at each later token that leaves the profile's share at the cap."""
    floor, at_cap = PROFILES[name]
    min_tokens = round(floor * cap)
    return min_tokens, 1 - at_cap ** (1 / (cap - min_tokens))


@functools.cache  # GRPOConfig's request and run.json's record: one tokenizer load
def resolve(name: str, cap: int, temperature: float, model_path: str, vocab_size: int) -> LengthProfile:
    """The profile `name` for completions of at most `cap` tokens sampled at `temperature` from the model at
    `model_path` with `vocab_size` embeddings (every id a random model may sample): the EOS token of its tokenizer,
    the one vLLM stops at and TRL counts as an ending."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
    min_tokens, chance = floor_and_chance(name, cap)
    # EOS's chance with its logit raised by b / temperature and vocab_size - 1 equal others: e^(b/T) / (e^(b/T) + V - 1)
    bias = temperature * math.log(chance * (vocab_size - 1) / (1 - chance))
    profile = LengthProfile(name, int(eos), cap, min_tokens, chance, round(bias, 4))
    log.info("%s", profile.line())
    return profile
