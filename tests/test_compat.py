"""What compat/ knows of TRL's internals, checked against TRL itself on synthetic engine outputs. TRL's generation
module and vLLM are imported by the tests that use them, not at collection (each pytest worker collects every file)."""

from types import SimpleNamespace

import pytest
import torch

from colocated_grpo.compat import trl as trl_internals


def _request(*sequences):
    return SimpleNamespace(outputs=[SimpleNamespace(logprobs=s) for s in sequences])


def _flat(positions):
    from vllm.logprobs import FlatLogprobs, Logprob

    flat = FlatLogprobs()
    for position in positions:
        flat.append({token: Logprob(logprob=value, rank=rank) for token, value, rank in position})
    return flat


def test_flat_log_probs_read_directly_equal_trls_parser_nan_included():
    from trl.generation.vllm_generation import extract_logprobs

    sequences = [_flat([[(5, -0.5, 1)], [(9, float("nan"), 1)], [(2, -3.25, 4)]]), _flat([[(7, -0.1, 1)]])]
    outputs = [_request(sequences[0]), _request(sequences[1])]
    fast = trl_internals.read_flat_logprobs(outputs)
    assert fast == extract_logprobs(outputs)
    assert fast == ([[[-0.5], [None], [-3.25]], [[-0.1]]], [[[5], [9], [2]], [[7]]])


def test_anything_but_one_flat_entry_per_position_goes_to_trls_parser():
    from trl.generation.vllm_generation import extract_logprobs
    from vllm.logprobs import Logprob

    top2 = _flat([[(5, -0.5, 1), (6, -1.5, 2)], [(9, -0.2, 1), (1, -2.0, 2)]])  # logprobs=1: two per position
    as_dicts = [{3: Logprob(logprob=-0.7, rank=1)}]
    for outputs in ([_request(top2)], [_request(as_dicts)]):
        assert trl_internals.read_flat_logprobs(outputs) == extract_logprobs(outputs)
    assert trl_internals.read_flat_logprobs([_request(None)]) == (None, None)


def _generation(mode="colocate", zero3=False, fsdp=None):
    return SimpleNamespace(
        mode=mode,
        _iter_named_params=lambda: iter(()),
        _dist=SimpleNamespace(is_zero3=zero3, fsdp_version=fsdp),
        model=torch.nn.Module(),  # accelerate's is_peft_model reads it as a module once peft is installed
    )


@pytest.mark.parametrize(
    ("generation", "plan"),
    [
        (_generation(), "one_call"),
        (_generation(fsdp=2), "chunked"),
        (_generation(fsdp=1), None),
        (_generation(zero3=True), None),
        (_generation(mode="server"), None),
    ],
)
def test_weight_sync_is_batched_only_where_trls_tensors_outlive_its_iterator(generation, plan):
    from colocated_grpo.generation.in_process import fast_sync_plan

    assert fast_sync_plan(generation) == plan


def test_colocated_engines_get_the_extra_arguments_over_trls_own(monkeypatch):
    """placement.cpu_eager reaches TRL's `LLM(...)` call this way; wrapping twice keeps one layer."""
    import trl.generation.vllm_generation as vllm_generation

    from colocated_grpo.compat import trl as trl_internals

    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda *args, **kwargs: built.append(kwargs))
    trl_internals.build_colocated_engines_with(enforce_eager=True)
    trl_internals.build_colocated_engines_with(enforce_eager=True)
    vllm_generation.LLM(model="m", enforce_eager=False, max_num_batched_tokens=4096)
    assert built == [{"model": "m", "enforce_eager": True, "max_num_batched_tokens": 4096}]


def test_a_checkpoint_loads_onto_an_indexed_cpu_device(tmp_path):
    """A multi-rank CPU run resumes its optimizer's state with map_location cpu:<rank> (accelerate's device), which
    torch 2.11 does not restore by itself."""
    import torch

    from colocated_grpo.compat.torch_checkpoints import restore_indexed_cpu_locations

    path = tmp_path / "optimizer.pt"
    torch.save({"exp_avg": torch.arange(3.0)}, path)
    restore_indexed_cpu_locations()
    loaded = torch.load(path, map_location=torch.device("cpu", 1), weights_only=True)
    assert loaded["exp_avg"].tolist() == [0.0, 1.0, 2.0]
