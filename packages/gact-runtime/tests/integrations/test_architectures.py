"""Breadth: on every architecture of ``hf_architectures.py``, in fp32, under bfloat16 autocast and
with transformers' gradient checkpointing (and on a few of them under float16 autocast, in
channels-last memory, with frozen base weights, with a gradient penalty and compiled with
``aot_eager``), level L0 gives gradients bit-identical to PyTorch's and the mean of four L1
gradients (four rounding seeds, the same dropout masks) points where the exact gradient points.

What the second check catches: a save unpacked as the wrong tensor, a decision (a mask, a
maximum's position) taken from rounded values, a dtype or layout restored wrongly. Checked by
planting such bugs: without decision projections MobileNetV2's cosine fell to 0.845, without
restoring rotated groups 22 cases failed, with views of a save read back flipped 7. What it
cannot catch is a small bias: the per-operation tests in ``test_gradients.py`` measure that.
Both checks are deterministic (fixed model, batch, dropout and rounding seeds), so they have no
false-alarm rate on a given torch and transformers; the margins (cosine at least 0.98, norm
within 10% of the exact one, where the smallest cosine measured was 0.9928 and the norms
within 1.1%, on these models and on the same models built from seed 1) leave room for other
builds' arithmetic.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from gact import Controller, GactConfig, GactWarning
from hf_architectures import ARCHITECTURES, build

pytest.importorskip("transformers")

SEEDS = 4
MIN_COSINE = 0.98
NORM_TOLERANCE = 0.1
MODES = ("fp32", "bf16-autocast", "checkpointing")
#: more of what users do, each on a few architectures
MORE_MODES = {
    "fp16-autocast": ("mistral", "roberta", "mamba", "resnet", "swin"),
    "channels-last": ("resnet", "convnext", "mobilenet_v2", "regnet", "swin"),
    # LoRA-style: the base weights frozen, only the attention's queries and values and the head
    "frozen-base": ("mistral", "qwen2", "gemma2", "roberta"),
    # a gradient penalty: the backward itself differentiated (create_graph=True)
    "gradient-penalty": ("roberta", "resnet", "convnext", "swin"),
    # ``model.compile(backend="aot_eager")``: rotary decoders save ``cat`` outputs, mixtures
    # of experts a grouped product's operands, MobileNetV2 ReLU6 inputs, Mamba softplus inputs
    "compiled": ("mistral", "gpt_neox", "qwen3", "mixtral", "mobilenet_v2", "mamba"),
}
_TRAINED = ("q_proj", "v_proj", "query", "value", "classifier", "score")
_AUTOCAST = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}


def _gradients(model: torch.nn.Module, loss_fn, mode: str, level: str | None, seed: int = 0):
    """The loss and the flat gradient of one forward and backward (dropout seed 0)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    if mode == "compiled":  # a graph compiled without the hooks would run without them
        torch._dynamo.reset()
    dtype = _AUTOCAST.get(mode)
    autocast = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    controller = (
        None if level is None else Controller(model, GactConfig.from_level(level, seed=seed))
    )
    with controller or contextlib.nullcontext(), autocast:
        loss = loss_fn()
        if mode == "gradient-penalty":
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + sum(g.square().sum() for g in grads)
        loss.backward()
    grads = [p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None]
    return loss.detach(), torch.cat(grads), controller


def _prepare(model: torch.nn.Module, model_type: str, mode: str) -> None:
    if mode == "checkpointing":
        if not model.supports_gradient_checkpointing:
            pytest.skip(f"{model_type} does not support gradient checkpointing")
        # (transformers 5 renamed it; the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    elif mode == "compiled":
        model.compile(backend="aot_eager")
    elif mode == "channels-last":
        model.to(memory_format=torch.channels_last)
    elif mode == "frozen-base":
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(any(part in name for part in _TRAINED))


@pytest.mark.parametrize(
    ("model_type", "mode"),
    [(name, mode) for name in ARCHITECTURES for mode in MODES]
    + [(name, mode) for mode, names in MORE_MODES.items() for name in names],
)
def test_level_zero_is_exact_and_level_one_points_at_the_exact_gradient(
    model_type: str, mode: str
) -> None:
    try:
        model, loss_fn = build(model_type)
    except ValueError as error:  # a model type this transformers does not have
        pytest.skip(str(error))
    _prepare(model, model_type, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GactWarning)  # e.g. a decision GACT did not see
        loss, exact, _ = _gradients(model, loss_fn, mode, None)
        loss0, grad0, _ = _gradients(model, loss_fn, mode, "L0")
        assert torch.equal(loss0, loss)
        assert torch.equal(grad0, exact)
        mean = torch.zeros_like(exact, dtype=torch.float64)
        for seed in range(SEEDS):
            _, grad, controller = _gradients(model, loss_fn, mode, "L1", seed)
            assert controller.stats()["compressed_tensors"] > 0
            mean += grad.double() / SEEDS
    exact = exact.double()
    cosine = float(mean @ exact / (mean.norm() * exact.norm()))
    assert cosine >= MIN_COSINE, f"{model_type} ({mode}): cosine {cosine:.4f}"
    assert abs(float(mean.norm() / exact.norm()) - 1) <= NORM_TOLERANCE


def test_library_functions_read_by_gact_are_compressed() -> None:
    """NOTE [Custom functions] in origins.py: what a ``torch.autograd.Function`` saves is kept,
    except for the library Functions GACT has read (``COMPRESSED_FUNCTIONS``): BLOOM's GELU,
    whose input is the largest save of its MLP, is compressed as any activation (kept, BLOOM's
    L1 ratio would fall from 6.8x to 3.4x on this model)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    ids = torch.randint(0, 64, (4, 16))
    with Controller(model.train(), GactConfig.from_level("L1", min_numel=0)) as controller:
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step()
    kinds = {key: r.kind.name for key, r in controller.ledger.last.items()}
    assert kinds["transformer.h.0.mlp.gelu_impl#0:float32:3d"] == "QUANTIZED"
