"""End to end on a GPU (run on a GPU machine: `pytest -m gpu`): FSDP2 with the colocated engine, which accelerate
turns on only for GPU-like devices."""

import json

import pytest
import torch
from conftest import assert_weights_reach_the_engine, sync_off_from

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run with `pytest -m gpu`)"),
]


def test_fsdp2_syncs_gathered_weights_to_the_engine_in_chunks(train):
    """Every GPU a rank; a policy that moves each step. vLLM's sampling log-probs keep matching the trainer's only
    if the gathered full weights reach the engine at every sync (loaded in chunks under placement.sync_chunk_gb);
    step 4 runs without the sync and must fail that check."""
    ranks = torch.cuda.device_count()
    run = train(
        "parallelism=fsdp",
        f"parallelism.nproc_per_node={ranks}",
        "trainer.learning_rate=0.02",
        "trainer.max_steps=4",
        "+reward.weights.even_token_share=1.0",
        "placement.sync_chunk_gb=0.001",  # the tiny model's ~1 MB: several chunks per sync
        "logger=none",
        *sync_off_from(4),
        nproc=ranks,
    )
    assert json.loads((run.dir / "run.json").read_text())["distributed_type"] == "FSDP"
    assert "weight sync: chunked" in run.output
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2, 3, 4]
    assert_weights_reach_the_engine(metrics, off_from=4)
