"""Packed micro-batches (training/packing.py, run.pack_micro_batches): one packed forward gives the log-probs,
entropies, loss and gradients of TRL's padded forward, on sequences of mixed lengths with left-padded prompts and
right-padded completions, grouped-query attention included, under gradient checkpointing (reentrant or not), with a
sliding window and with LoRA adapters; a packing that lets sequences see each other does not; attention the packed
kernel does not compute is refused."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from colocated_grpo.training import packing

PROMPT, COMPLETION = 7, 9
PROMPT_LENGTHS, COMPLETION_LENGTHS = [7, 3, 5, 1], [9, 2, 6, 4]
# fp32 on CPU: the two paths differ by the order of a few reductions
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def batch():
    return mixed_batch()


def tiny_model(**changes):
    torch.manual_seed(0)
    config = Qwen2Config(
        **{"attn_implementation": "sdpa", **changes},
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as Qwen2.5's
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config)
    add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    return model


def mixed_batch():
    """A micro-batch as TRL builds it: prompts padded on the left, completions on the right."""
    torch.manual_seed(1)
    mask = torch.zeros(len(PROMPT_LENGTHS), PROMPT + COMPLETION, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True)):
        mask[row, PROMPT - prompt : PROMPT + completion] = 1
    input_ids = torch.randint(1, 300, mask.shape).masked_fill(mask == 0, 0)
    return input_ids, mask


def _padded(model, input_ids, mask):
    """TRL 1.16's forward (GRPOTrainer._get_per_token_logps_and_entropies): the padded batch, its fused LM head."""
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION] = -100
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -COMPLETION:], out.entropy[:, -COMPLETION:]


def _loss_and_grads(model, logps, completion_mask):
    loss = -(logps * completion_mask).sum() / completion_mask.sum()
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _difference(a, b, completion_mask):
    return ((a - b).abs() * completion_mask).max().item()


def test_packed_forward_gives_the_padded_forwards_logps_entropies_loss_and_gradients(model, batch):
    input_ids, mask = batch
    completion_mask = mask[:, -COMPLETION:].float()
    padded_logps, padded_entropy = _padded(model, input_ids, mask)
    padded_loss, padded_grads = _loss_and_grads(model, padded_logps, completion_mask)
    logps, entropy = packing.per_token_logps(model, model.config, input_ids, mask, COMPLETION, compute_entropy=True)
    loss, grads = _loss_and_grads(model, logps, completion_mask)

    assert logps.shape == padded_logps.shape == (len(PROMPT_LENGTHS), COMPLETION)
    assert _difference(logps, padded_logps, completion_mask) < TOLERANCE
    assert _difference(entropy, padded_entropy, completion_mask) < TOLERANCE
    assert (logps * (1 - completion_mask)).abs().max() == 0, "0 where the padded batch held padding"
    assert abs(loss - padded_loss) < TOLERANCE
    assert max((a - b).abs().max().item() for a, b in zip(grads, padded_grads, strict=True)) < TOLERANCE
    assert model.config._attn_implementation == packing.PACKABLE + "sdpa", (
        "the dispatcher again after the packed forward"
    )


def test_a_packing_that_lets_sequences_see_each_other_is_caught(model, batch, monkeypatch):
    """The negative control: the whole packed row attended as one sequence (positions still restarting)."""
    input_ids, mask = batch
    completion_mask = mask[:, -COMPLETION:].float()
    padded_logps, _ = _padded(model, input_ids, mask)
    attend = packing.varlen_attention

    def as_one_sequence(module, query, key, value, attention_mask, **kwargs):
        whole = torch.tensor([0, query.shape[2]], dtype=torch.int32)
        return attend(module, query, key, value, attention_mask, **{**kwargs, "cu_seq_lens": whole})

    monkeypatch.setattr(packing, "varlen_attention", as_one_sequence)
    try:
        with torch.no_grad():
            mixed, _ = packing.per_token_logps(model, model.config, input_ids, mask, COMPLETION, compute_entropy=False)
    finally:
        monkeypatch.undo()
    assert _difference(mixed, padded_logps.detach(), completion_mask) > 100 * TOLERANCE


def test_packing_keeps_each_sequences_positions_and_boundaries(batch):
    input_ids, mask = batch
    packed = packing.Packed.of(input_ids, mask)
    lengths = [p + c for p, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True)]
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.cu_seq_lens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert packed.max_length == max(lengths)
    assert torch.equal(packed.input_ids[0], input_ids[mask.bool()])


def _padded_reference(batch, **changes):
    """TRL's padded forward's loss and gradients on a fresh tiny model (the model's own attention, never made
    packable), without checkpointing."""
    input_ids, mask = batch
    reference = tiny_model(**changes)
    logps, _ = _padded(reference, input_ids, mask)
    return _loss_and_grads(reference, logps, mask[:, -COMPLETION:].float())


def _packed_loss_and_grads(model, batch):
    input_ids, mask = batch
    logps, _ = packing.per_token_logps(model, model.config, input_ids, mask, COMPLETION, compute_entropy=False)
    return _loss_and_grads(model, logps, mask[:, -COMPLETION:].float())


def _largest_difference(grads, other) -> float:
    return max((a - b).abs().max().item() for a, b in zip(grads, other, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_under_gradient_checkpointing_the_packed_gradients_are_the_padded_ones(batch, reentrant):
    """Checkpointing recomputes each layer in the backward, after the packed forward has returned: the recompute must
    take the packed attention too (it ran the model's own over the whole packed row: an error without reentrancy,
    wrong gradients with it)."""
    padded_loss, padded_grads = _padded_reference(batch)
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    loss, grads = _packed_loss_and_grads(model, batch)
    assert abs(loss - padded_loss) < TOLERANCE
    assert _largest_difference(grads, padded_grads) < TOLERANCE


def test_a_sliding_window_is_kept_by_the_packed_attention(batch):
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)  # every layer slides
    padded_loss, padded_grads = _padded_reference(batch, **window)
    model = tiny_model(**window)
    assert model.model.layers[0].self_attn.sliding_window == 4, "the window reaches the attention"
    loss, grads = _packed_loss_and_grads(model, batch)
    assert abs(loss - padded_loss) < TOLERANCE
    assert _largest_difference(grads, padded_grads) < TOLERANCE
    _, full_attention_grads = _padded_reference(batch)
    assert _largest_difference(grads, full_attention_grads) > 100 * TOLERANCE, "the window changes the result here"


def test_lora_adapters_get_the_padded_gradients_from_the_packed_forward(batch):
    from peft import LoraConfig, get_peft_model

    def lora_model():
        torch.manual_seed(2)
        adapted = get_peft_model(
            tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
        return adapted

    input_ids, mask = batch
    reference = lora_model()
    padded_loss, padded_grads = _loss_and_grads(
        reference, _padded(reference, input_ids, mask)[0], mask[:, -COMPLETION:].float()
    )
    model = lora_model()
    loss, grads = _packed_loss_and_grads(model, batch)
    assert 0 < len(grads) < len(list(model.parameters())), "only the adapters train"
    assert abs(loss - padded_loss) < TOLERANCE
    assert _largest_difference(grads, padded_grads) < TOLERANCE


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"attn_implementation": "eager"}, "its attention is 'eager'"),
        ({"attention_dropout": 0.1}, "dropout"),
    ],
    ids=["eager", "dropout"],
)
def test_attention_the_packed_kernel_does_not_compute_is_refused(changes, why):
    assert packing.why_not_packable(tiny_model()) is None
    assert why in packing.why_not_packable(tiny_model(**changes))


def test_attention_sinks_reaching_the_packed_attention_stop_it_in_one_line(batch):
    query = torch.zeros(1, 4, 5, 16)
    boundaries = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="does not compute \\['s_aux'\\]"):
        packing.varlen_attention(
            None, query, query, query, None, cu_seq_lens=boundaries, max_length=5, s_aux=torch.zeros(4)
        )


def test_the_variable_length_kernel_runs_only_where_flashattention_takes_the_model_s_dtype():
    """PyTorch's varlen_attn is FlashAttention 2, CUDA in float16 or bfloat16: a float32 model on a GPU (the GPU
    tests' tiny models) packs through SDPA a sequence at a time, as on CPU; varlen_attn raised in its first forward."""
    assert packing.varlen_kernel_runs(True, torch.bfloat16) and packing.varlen_kernel_runs(True, torch.float16)
    assert not packing.varlen_kernel_runs(True, torch.float32)
    assert not packing.varlen_kernel_runs(False, torch.bfloat16)
    assert packing.kernel(torch.float32) == "SDPA one sequence at a time: no variable-length kernel on CPU"
