"""A reward of weight 0 that records every rank's sampled token ids per step, to compare runs token by token.

Loaded with `+reward.modules=[token_recorder] +reward.weights.records_token_ids=0`; writes
`$TOKEN_RECORD_DIR/tokens-rank<RANK>.jsonl` (one line per call: the step being trained and the token ids).
"""

import json
import os
from pathlib import Path

from colocated_grpo.training.rewards import register


@register
def records_token_ids(completions, completion_ids, trainer_state, **_):
    path = Path(os.environ["TOKEN_RECORD_DIR"]) / f"tokens-rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step + 1, "ids": [list(c) for c in completion_ids]}) + "\n")
    return [0.0] * len(completions)
