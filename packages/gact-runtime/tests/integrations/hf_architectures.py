"""transformers architectures from tiny configs, each with a loss on a fixed batch (imported as a
module by ``test_architectures.py``; pytest puts this folder on ``sys.path``).

The model matrix (``family_models.py``) trains four transformers families in depth; these are
the breadth: the layouts users bring (decoders with rotary or ALiBi positions, grouped-query
and sliding-window attention, mixtures of experts, a state-space model, encoders with relative
or disentangled attention, encoder-decoders, windowed vision transformers, CNNs in the
transformers layout), each built by ``AutoConfig.for_model`` so that only the model type and
its size are named here. Weights are random, nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Loss = Callable[[], torch.Tensor]

VOCAB = 128
_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
_GQA = {"num_key_value_heads": 2}

#: model type -> (head, config options beyond the type's defaults); head is "causal",
#: "classify" (sequence classification), "seq2seq" or "image"
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("causal", _TEXT),
    "gptj": ("causal", {**_TEXT, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "opt": ("causal", {**_TEXT, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    "bloom": ("causal", {**_TEXT, "n_layer": 2, "n_head": 4}),
    "falcon": ("causal", _TEXT),
    "phi": ("causal", _TEXT),
    "phi3": ("causal", {**_TEXT, "pad_token_id": 0}),
    "mistral": ("causal", {**_TEXT, **_GQA}),
    "qwen2": ("causal", {**_TEXT, **_GQA}),
    "qwen3": ("causal", {**_TEXT, **_GQA, "head_dim": 16}),
    "gemma": ("causal", {**_TEXT, **_GQA, "head_dim": 16}),
    "gemma2": ("causal", {**_TEXT, **_GQA, "head_dim": 16}),
    "mixtral": ("causal", {**_TEXT, **_GQA, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "causal",
        {
            **_TEXT,
            **_GQA,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "olmo": ("causal", {**_TEXT, **_GQA}),
    "stablelm": ("causal", {**_TEXT, **_GQA}),
    "starcoder2": ("causal", {**_TEXT, **_GQA}),
    "mamba": ("causal", {**_TEXT, "state_size": 8}),
    "roberta": ("classify", _TEXT),
    "distilbert": (
        "classify",
        {**_TEXT, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128},
    ),
    "albert": ("classify", {**_TEXT, "embedding_size": 32}),
    "electra": ("classify", {**_TEXT, "embedding_size": 32}),
    "deberta-v2": ("classify", _TEXT),
    "modernbert": (
        "classify",
        {
            **_TEXT,
            "global_attn_every_n_layers": 2,
            "local_attention": 16,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
    ),
    "t5": (
        "seq2seq",
        {
            "vocab_size": VOCAB,
            "d_model": 64,
            "d_kv": 16,
            "d_ff": 128,
            "num_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
    ),
    "bart": (
        "seq2seq",
        {
            "vocab_size": VOCAB,
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "max_position_embeddings": 64,
        },
    ),
    "swin": (
        "image",
        {"patch_size": 2, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
    ),
    "convnext": ("image", {"hidden_sizes": [8, 16, 24, 32], "depths": [1, 1, 1, 1]}),
    "resnet": ("image", {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16}),
    "mobilenet_v2": ("image", {"depth_multiplier": 0.35}),
    "regnet": ("image", {"hidden_sizes": [16, 32], "depths": [1, 1], "groups_width": 8}),
}


def build(model_type: str, seed: int = 0) -> tuple[nn.Module, Loss]:
    """A fresh model of ``model_type`` (weights and batch from ``seed``, in training mode:
    dropout on) and its loss.

    Raises:
        ValueError: if the installed transformers does not know ``model_type``.
    """
    import transformers

    head, options = ARCHITECTURES[model_type]
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (2, 32), generator=gen)
    torch.manual_seed(seed)
    if head == "image":
        config = transformers.AutoConfig.for_model(
            model_type, image_size=32, num_channels=3, num_labels=5, **options
        )
        model = transformers.AutoModelForImageClassification.from_config(config)
        images = torch.randn(8, 3, 32, 32, generator=gen)
        labels = torch.arange(8) % 5
        model.train()
        return model, lambda: model(pixel_values=images, labels=labels).loss
    if head == "classify":
        config = transformers.AutoConfig.for_model(model_type, num_labels=3, **options)
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        labels = torch.tensor([0, 2])
        model.train()
        return model, lambda: model(input_ids=ids, labels=labels).loss
    config = transformers.AutoConfig.for_model(model_type, **options)
    if head == "seq2seq":
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
        targets = ids[:, :16].contiguous()
        model.train()
        return model, lambda: model(input_ids=ids, labels=targets).loss
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model, lambda: model(input_ids=ids, labels=ids).loss
