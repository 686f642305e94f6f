"""Reference models: flavors, overrides, dtypes, meta builds, user factories, bad input."""

from __future__ import annotations

import logging

import pytest
import torch

from workbench.capture.fits import available_bytes
from workbench.capture.models import (
    REFERENCE_MODELS,
    Workload,
    load_workload,
    model_names,
    parse_dtype,
    token_cross_entropy,
)
from workbench.capture.models.deepseek_v3 import MoE
from workbench.capture.models.llama3 import LLAMA3_FLAVORS, apply_rope, rope_tables
from workbench.capture.models.torchtitan import torchtitan_log
from workbench.errors import WorkbenchError


def test_registry_has_published_llama3_shapes() -> None:
    assert model_names() == [
        "dsv3-16b",
        "dsv3-debug",
        "llama3-1b",
        "llama3-3b",
        "llama3-405b",
        "llama3-70b",
        "llama3-8b",
        "llama3-debug",
    ]
    eight = LLAMA3_FLAVORS["8B"]
    assert (eight.dim, eight.n_layers, eight.n_heads, eight.n_kv_heads) == (4096, 32, 32, 8)
    assert (eight.ffn_hidden, eight.vocab_size, eight.rope_theta) == (14336, 128256, 500000.0)
    assert LLAMA3_FLAVORS["1B"].tie_embeddings and not eight.tie_embeddings


def test_8b_on_meta_has_8b_parameters() -> None:
    workload = load_workload("llama3-8b", device="meta")
    n = sum(p.numel() for p in workload.model.parameters())
    assert 8.0e9 < n < 8.1e9
    assert all(p.is_meta for p in workload.model.parameters())


def test_dsv3_16b_on_meta_has_torchtitans_moe_shape() -> None:
    """torchtitan's deepseek_v3 16B: 27 layers (one dense), 64 routed experts of hidden 1408
    over dim 2048, top 6, its training batch; 14.39B routed-expert parameters, 15.79B in all
    (GQA attention, not MLA: attention's count is not torchtitan's)."""
    workload = load_workload("dsv3-16b", device="meta")
    model = workload.model
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE) and not isinstance(model.layers["0"].feed_forward, MoE)
    assert tuple(moe.experts.w1.shape) == (64, 2048, 1408) and moe.top_k == 6
    assert len(model.layers) == 27 and tuple(workload.inputs[0].shape) == (4, 4096)
    named = dict(model.named_parameters())
    routed = sum(p.numel() for name, p in named.items() if ".experts." in name)
    assert routed == 26 * 3 * 64 * 2048 * 1408
    assert sum(p.numel() for p in named.values()) == 15_787_866_112


@pytest.mark.parametrize(
    ("name", "shape", "low", "high"),
    [
        ("llama3-70b", (8192, 80, 64, 8, 28672), 70.5e9, 70.6e9),
        ("llama3-405b", (16384, 126, 128, 8, 53248), 405.8e9, 405.9e9),
    ],
)
def test_70b_and_405b_have_torchtitans_shapes(
    name: str, shape: tuple[int, ...], low: float, high: float
) -> None:
    """torchtitan's `llama3` 70B and 405B args (its FFN rule resolved: multiplier 1.3 and
    1.2, multiple of 4096), the published parameter counts, on meta."""
    workload = load_workload(name, device="meta")
    config = workload.model.config
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == shape[:4]
    assert (config.ffn_hidden, config.vocab_size, config.rope_theta) == (shape[4], 128256, 5e5)
    assert low < sum(p.numel() for p in workload.model.parameters()) < high
    assert workload.tokens == 8192


def test_tied_embeddings_share_one_parameter() -> None:
    workload = load_workload("llama3-1b", layers=1, device="meta")
    model = workload.model
    assert model.output.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names


def test_overrides_shrink_shapes() -> None:
    workload = load_workload("llama3-debug", layers=2, seq=32, batch=3)
    assert len(workload.model.layers) == 2
    assert workload.inputs[0].shape == (3, 32)
    assert workload.target.shape == (3, 32)
    assert workload.tokens == 96
    assert workload.config == {"layers": 2, "seq": 32, "batch": 3, "dtype": "float32"}


def test_target_is_next_token() -> None:
    workload = load_workload("llama3-debug", layers=1, seq=16, batch=1)
    # inputs and target come from one sequence shifted by one position
    assert torch.equal(workload.inputs[0][0, 1:], workload.target[0, :-1])


def test_bfloat16_build() -> None:
    workload = load_workload("llama3-debug", layers=1, seq=16, dtype="bfloat16")
    assert {p.dtype for p in workload.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    logits = workload.model(*workload.inputs)
    assert logits.dtype == torch.bfloat16


def test_dsv3_has_dense_first_layer_and_moe_after() -> None:
    workload = load_workload("dsv3-debug")
    layers = list(workload.model.layers.values())
    assert not isinstance(layers[0].feed_forward, MoE)
    assert all(isinstance(layer.feed_forward, MoE) for layer in layers[1:])
    logits = workload.model(*workload.inputs)
    assert logits.shape == (2, 128, 2048) and torch.isfinite(logits).all()


def test_moe_matches_per_token_reference() -> None:
    """Grouped routed experts equal a plain loop over tokens and their top-k experts."""
    workload = load_workload("dsv3-debug", layers=2)
    moe = workload.model.layers["1"].feed_forward
    x = torch.randn(1, 6, 256)
    out = moe(x)
    tokens = x.reshape(-1, 256)
    scores, experts = moe.router(tokens)
    ref = moe.shared_experts(tokens)
    for t in range(tokens.shape[0]):
        for s, e in zip(scores[t], experts[t], strict=True):
            xb = tokens[t].to(torch.bfloat16)
            w1, w2, w3 = (
                w[e].to(torch.bfloat16) for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)
            )
            h = torch.nn.functional.silu(xb @ w1) * (xb @ w3)
            ref[t] += s * (h @ w2).float()
    torch.testing.assert_close(out.reshape(-1, 256), ref, rtol=2e-2, atol=2e-3)


def test_rope_rotation_preserves_norm() -> None:
    cos, sin = rope_tables(8, 5, 10000.0)
    x = torch.randn(1, 5, 2, 8)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is not rotated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"spec": "llama9"}, "unknown model 'llama9'; choose one of dsv3-16b, dsv3-debug"),
        ({"spec": "llama3-debug", "seq": 0}, "seq must be a positive integer"),
        ({"spec": "llama3-debug", "layers": -1}, "layers must be a positive integer"),
        ({"spec": "llama3-debug", "dtype": "float8"}, "unknown dtype 'float8'"),
        ({"spec": "no_such_module:factory"}, "cannot load model factory"),
        ({"spec": "user_models:missing"}, "cannot load model factory"),
        ({"spec": "user_models:mlp_with_loss", "seq": 4}, "takes no seq argument"),
        ({"spec": "user_models:not_a_model"}, "model must be a torch.nn.Module"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict, message: str) -> None:
    spec = kwargs.pop("spec")
    with pytest.raises(WorkbenchError, match=message.replace("(", r"\(")):
        load_workload(spec, **kwargs)


def test_real_build_that_cannot_fit_is_refused() -> None:
    with pytest.raises(WorkbenchError, match=r"llama3-8b needs at least .* GiB .*--mode fake"):
        load_workload("llama3-8b")
    assert available_bytes(torch.device("cpu")) > 0


def test_cuda_without_gpu_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(WorkbenchError, match="no CUDA GPU"):
        load_workload("llama3-debug", device="cuda")


def test_user_factories() -> None:
    plain = load_workload("user_models:mlp", layers=3, batch=4)
    assert len(plain.model.blocks) == 3 and plain.inputs[0].shape == (4, 16)
    assert plain.loss_fn is token_cross_entropy
    with_loss = load_workload("user_models:mlp_with_loss")
    assert with_loss.loss_fn(torch.zeros(2, 4), torch.ones(2, 4)).item() == 8.0
    assert load_workload("user_models:mlp_workload").name == "mlp"


def test_workload_without_loss_or_usable_target_is_refused() -> None:
    with pytest.raises(WorkbenchError, match="has no loss function"):
        Workload(torch.nn.Linear(2, 2), torch.randn(1, 2), target=None, name="lin")
    mse = Workload(torch.nn.Linear(2, 2), torch.randn(1, 2), target=torch.zeros(1, 2))
    assert mse.loss_fn is not None and mse.tokens == 1


def test_parse_dtype() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float32) is torch.float32
    assert set(REFERENCE_MODELS) == set(model_names())


def test_torchtitan_log_sets_the_root_level_only_while_it_runs() -> None:
    """torchtitan logs through the root logger: its level and a handler hold inside the
    block only, also when the block fails."""
    root = logging.getLogger()
    before, handlers = root.level, list(root.handlers)
    handler = logging.NullHandler()
    with pytest.raises(ValueError), torchtitan_log(logging.DEBUG, handler):
        assert root.level == logging.DEBUG and handler in root.handlers
        raise ValueError
    assert root.level == before and root.handlers == handlers
