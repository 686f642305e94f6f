"""Hugging Face `transformers` models built from small configs, as a user writes them:
`hf:NAME` (`hf:llama`, `hf:qwen2`, `hf:qwen2-moe`, `hf:mixtral`, `hf:gpt2`, `hf:bert`,
`hf:vit`). Random weights, nothing downloaded; the model is called as `model(inputs)` and the
loss is computed from its `logits`, with the attention and experts kernels transformers picks
by default (SDPA; `grouped_mm` for MoE experts).

Entry point: `load_hf(spec, layers=, seq=, batch=, dtype=, device=, seed=)`, which
`workbench.capture.models.load_workload` calls for specs starting with `hf:`. `HF_MODELS`
lists the names; `check_transformers()` says how to install the library.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from workbench.capture.workload import Workload, token_cross_entropy, token_workload
from workbench.errors import WorkbenchError

__all__ = ["HF_MODELS", "PREFIX", "HfModel", "check_transformers", "load_hf"]

PREFIX = "hf:"
INSTALL_HINT = "pip install -e '.[test]' (or pip install transformers)"
Kind = Literal["causal", "masked", "image"]

# One size for all (the shape): hidden 256, 4 heads (2 key/value heads where the
# family has GQA), feed-forward 512, vocabulary 512, 2 layers, batch 2 x 64 tokens.
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 512
LAYERS, BATCH, SEQ = 2, 2, 64
PATCH = 8  # ViT: --seq counts patches, a square number (16: 32 x 32 images)
IMAGE_SEQ, CLASSES = 16, 10


@dataclass(frozen=True)
class HfModel:
    """One `hf:` name: the transformers classes (by name: the library loads lazily) and how
    its config takes the size flags."""

    config: str
    model: str
    kind: Kind
    make: Callable[[int, int], dict[str, Any]]  # (layers, seq) -> config kwargs


def _decoder(layers: int, seq: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": seq,
        "use_cache": False,  # a training step: no KV cache
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _moe(experts: dict[str, Any]) -> Callable[[int, int], dict[str, Any]]:
    return lambda layers, seq: {**_decoder(layers, seq), **experts}


def _gpt2(layers: int, seq: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "n_embd": HIDDEN,
        "n_layer": layers,
        "n_head": HEADS,
        "n_inner": FFN,
        "n_positions": seq,
        "use_cache": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _bert(layers: int, seq: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "intermediate_size": FFN,
        "max_position_embeddings": seq,
    }


def _vit(layers: int, seq: int) -> dict[str, Any]:
    side = math.isqrt(seq)
    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "intermediate_size": FFN,
        "image_size": side * PATCH,
        "patch_size": PATCH,
        "num_labels": CLASSES,
    }


HF_MODELS: dict[str, HfModel] = {
    "llama": HfModel("LlamaConfig", "LlamaForCausalLM", "causal", _decoder),
    "qwen2": HfModel("Qwen2Config", "Qwen2ForCausalLM", "causal", _decoder),
    "qwen2-moe": HfModel(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "causal",
        _moe(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 256,
            }
        ),
    ),
    "mixtral": HfModel(
        "MixtralConfig",
        "MixtralForCausalLM",
        "causal",
        _moe({"num_local_experts": 4, "num_experts_per_tok": 2}),
    ),
    "gpt2": HfModel("GPT2Config", "GPT2LMHeadModel", "causal", _gpt2),
    "bert": HfModel("BertConfig", "BertForMaskedLM", "masked", _bert),
    "vit": HfModel("ViTConfig", "ViTForImageClassification", "image", _vit),
}


def check_transformers() -> Any:
    """The `transformers` module, or one line saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise WorkbenchError(f"hf: models need transformers ({err}): {INSTALL_HINT}") from None


def logits_cross_entropy(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of a transformers output's `logits` (float32, as torchtitan)."""
    return token_cross_entropy(output.logits, labels)


def image_cross_entropy(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.float(), labels)


def _entry(spec: str) -> tuple[str, HfModel]:
    name = spec.removeprefix(PREFIX)
    if name not in HF_MODELS:
        raise WorkbenchError(
            f"unknown Hugging Face model {spec!r}; choose one of "
            f"{', '.join(PREFIX + n for n in HF_MODELS)}"
        )
    return name, HF_MODELS[name]


def _check_seq(spec: str, entry: HfModel, seq: int) -> None:
    if entry.kind == "image" and math.isqrt(seq) ** 2 != seq:
        raise WorkbenchError(
            f"{spec}: --seq counts image patches ({PATCH} x {PATCH} pixels each) and must be a "
            f"square number (16: 32 x 32 images), got {seq}"
        )


def build_model(spec: str, layers: int, seq: int, dtype: torch.dtype, device: Any) -> nn.Module:
    """The model of `spec` with random weights, built in `dtype` on `device` (meta: none)."""
    _, entry = _entry(spec)
    library = check_transformers()
    config = getattr(library, entry.config)(**entry.make(layers, seq))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(library, entry.model)(config)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model  # type: ignore[no-any-return]


def load_hf(
    spec: str,
    *,
    layers: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Workload:
    """`spec`'s training step: a causal LM on next tokens, BERT on masked-LM labels for
    every position, ViT on class labels; `--seq` of a ViT counts patches."""
    name, entry = _entry(spec)
    layers = layers or LAYERS
    batch = batch or BATCH
    seq = seq or (IMAGE_SEQ if entry.kind == "image" else SEQ)
    _check_seq(spec, entry, seq)
    torch.manual_seed(seed)
    model = build_model(spec, layers, seq, dtype, device)
    config = {
        "layers": layers,
        "seq": seq,
        "batch": batch,
        "dtype": str(dtype).removeprefix("torch."),
    }
    notes = [_kernels_note(model)]
    if entry.kind == "image":
        return _image_workload(model, spec, seq, batch, dtype, device, seed, config, notes)
    workload = token_workload(
        model, VOCAB, batch=batch, seq=seq, device=device, seed=seed, name=spec, config=config
    )
    workload.loss_fn = logits_cross_entropy
    workload.notes = notes
    return workload


def _image_workload(
    model: nn.Module,
    spec: str,
    seq: int,
    batch: int,
    dtype: torch.dtype,
    device: Any,
    seed: int,
    config: dict[str, Any],
    notes: list[str],
) -> Workload:
    side = math.isqrt(seq) * PATCH
    with torch.device(device):
        generator = None if str(device) == "meta" else torch.Generator(device).manual_seed(seed)
        pixels = torch.randn(batch, 3, side, side, generator=generator, dtype=dtype)
        labels = torch.randint(0, CLASSES, (batch,), generator=generator)
    return Workload(
        model, (pixels,), labels, image_cross_entropy, name=spec, config=config, notes=notes
    )


def _kernels_note(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None) or "default"
    moe = any(hasattr(config, k) for k in ("num_experts", "num_local_experts"))
    experts = getattr(config, "_experts_implementation", None) if moe else None
    note = f"transformers {check_transformers().__version__}: attention {attention!r}"
    return note + (f", experts {experts!r}" if experts else "")
