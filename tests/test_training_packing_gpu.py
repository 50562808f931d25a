"""Packed micro-batches on a GPU (run on a GPU machine: `pytest -m gpu`): the packed forward through PyTorch's
varlen_attn (FlashAttention 2, bf16, grouped-query attention) is as close to the exact log-probs, loss and gradients
as TRL's padded bf16 forward is, under gradient checkpointing too (its recompute packed as well); a packing that lets
sequences see each other is not."""

import copy

import pytest
import torch
from test_training_packing import COMPLETION, _difference, _loss_and_grads, _padded, mixed_batch, tiny_model

from colocated_grpo.training import packing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run with `pytest -m gpu`)"),
]
# bf16 rounds differently in the two paths: packed may be this many times further from the exact values than padded
# (plus a floor for the values padded happens to get exactly right)
WITHIN = 3.0
FLOOR = 1e-3


@pytest.fixture(scope="module")
def batch():
    return mixed_batch()


@pytest.fixture(scope="module")
def cpu_model():
    return tiny_model()


@pytest.fixture(scope="module")
def exact(cpu_model, batch):
    """The padded forward in fp32 on the CPU: the values both bf16 GPU paths are compared with."""
    input_ids, mask = batch
    logps, _ = _padded(cpu_model, input_ids, mask)
    loss, grads = _loss_and_grads(cpu_model, logps, mask[:, -COMPLETION:].float())
    return logps.detach(), loss, grads


@pytest.fixture(scope="module")
def gpu_model(cpu_model):
    return copy.deepcopy(cpu_model).to("cuda", torch.bfloat16)


def _errors(logps, loss, grads, exact, completion_mask):
    """How far a path's log-probs, loss and gradients are from the exact ones (largest absolute difference)."""
    exact_logps, exact_loss, exact_grads = exact
    return {
        "logps": _difference(logps.float().cpu(), exact_logps, completion_mask),
        "loss": abs(loss.float().cpu() - exact_loss).item(),
        "grads": max((a.float().cpu() - b).abs().max().item() for a, b in zip(grads, exact_grads, strict=True)),
    }


def test_packed_varlen_forward_is_as_exact_as_the_padded_one_in_bf16(gpu_model, batch, exact):
    input_ids, mask = (t.cuda() for t in batch)
    completion_mask = mask[:, -COMPLETION:].float()
    cpu_mask = completion_mask.cpu()
    padded_logps, _ = _padded(gpu_model, input_ids, mask)
    padded = _errors(padded_logps, *_loss_and_grads(gpu_model, padded_logps, completion_mask), exact, cpu_mask)
    assert packing.kernel(gpu_model.dtype) == "PyTorch's varlen_attn, FlashAttention 2"
    logps, _ = packing.per_token_logps(gpu_model, gpu_model.config, input_ids, mask, COMPLETION, compute_entropy=False)
    packed = _errors(logps, *_loss_and_grads(gpu_model, logps, completion_mask), exact, cpu_mask)
    print(f"bf16 error against fp32: padded {padded}, packed {packed}")
    for key in padded:
        assert packed[key] <= WITHIN * padded[key] + FLOOR, (key, packed, padded)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_under_gradient_checkpointing_the_packed_gradients_are_as_exact_as_the_padded_ones(
    cpu_model, batch, exact, reentrant
):
    input_ids, mask = (t.cuda() for t in batch)
    completion_mask = mask[:, -COMPLETION:].float()
    cpu_mask = completion_mask.cpu()
    model = copy.deepcopy(cpu_model).to("cuda", torch.bfloat16)
    padded_logps, _ = _padded(model, input_ids, mask)
    padded = _errors(padded_logps, *_loss_and_grads(model, padded_logps, completion_mask), exact, cpu_mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    logps, _ = packing.per_token_logps(model, model.config, input_ids, mask, COMPLETION, compute_entropy=False)
    packed = _errors(logps, *_loss_and_grads(model, logps, completion_mask), exact, cpu_mask)
    print(f"bf16 error against fp32 with checkpointing (reentrant {reentrant}): padded {padded}, packed {packed}")
    for key in padded:
        assert packed[key] <= WITHIN * padded[key] + FLOOR, (key, packed, padded)


def test_a_varlen_packing_that_lets_sequences_see_each_other_is_caught(gpu_model, batch, exact, monkeypatch):
    input_ids, mask = (t.cuda() for t in batch)
    cpu_mask = mask[:, -COMPLETION:].float().cpu()
    with torch.no_grad():
        padded_logps, _ = _padded(gpu_model, input_ids, mask)
    attend = packing.varlen_attention

    def as_one_sequence(module, query, key, value, attention_mask, **kwargs):
        whole = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
        return attend(module, query, key, value, attention_mask, **{**kwargs, "cu_seq_lens": whole})

    monkeypatch.setattr(packing, "varlen_attention", as_one_sequence)
    try:
        with torch.no_grad():
            mixed, _ = packing.per_token_logps(gpu_model, gpu_model.config, input_ids, mask, COMPLETION, False)
    finally:
        monkeypatch.undo()
    padded_error = _difference(padded_logps.float().cpu(), exact[0], cpu_mask)
    mixed_error = _difference(mixed.float().cpu(), exact[0], cpu_mask)
    print(f"bf16 log-prob error against fp32: padded {padded_error}, mixed {mixed_error}")
    assert mixed_error > 10 * padded_error + FLOOR  # on CPU in fp32: 0.34 mixed, 0.0029 padded in bf16


def test_a_float32_model_packs_on_a_gpu_one_sequence_at_a_time_as_its_padded_forward_computes(cpu_model, batch):
    """FlashAttention, which varlen_attn runs, takes float16 and bfloat16 only: a float32 model (the tiny models of
    the GPU tests) packs through SDPA a sequence at a time, as on CPU, and gives its padded forward's log-probs."""
    model = copy.deepcopy(cpu_model).to("cuda")
    input_ids, mask = (t.cuda() for t in batch)
    assert packing.kernel(model.dtype).startswith("SDPA one sequence at a time: FlashAttention takes")
    with torch.no_grad():
        padded, _ = _padded(model, input_ids, mask)
        packed, _ = packing.per_token_logps(model, model.config, input_ids, mask, COMPLETION, compute_entropy=False)
    assert _difference(packed.cpu(), padded.cpu(), mask[:, -COMPLETION:].float().cpu()) < 1e-4
