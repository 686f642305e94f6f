"""Graphs traced for a GPU on a CPU (`workbench.capture.kernels`, `workbench.capture.flex`):
torch's CUDA SDPA selection as sdp_utils.cpp writes it, the GPU kernels' nodes and what they
save, flex attention as its own op, and what changes against the CPU's kernels."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from workbench.capture.flex import block_mask_sparsity, causal_block_mask
from workbench.capture.gpu_norm import (
    FUSED_RMS_NORM,
    fused_rms_norm,
    fuses,
    restore_fused_rms_norm,
)
from workbench.capture.graph import JointGraph
from workbench.capture.kernels import (
    KERNEL_TARGETS,
    check_kernels,
    gpu_kernels,
    resolve_kernels,
    sdpa_backend,
)
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.capture.workload import Workload
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import remat

H100 = KERNEL_TARGETS["h100"]
BF16 = torch.bfloat16
needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)


def _qkv(
    dtype: torch.dtype = BF16, d_qk: int = 64, d_v: int = 64, kv_heads: int = 4
) -> tuple[torch.Tensor, ...]:
    q = torch.empty(2, 4, 128, d_qk, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(2, kv_heads, 128, d_qk, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty(2, kv_heads, 128, d_v, dtype=dtype, device="meta", requires_grad=True)
    return q, k, v


@contextmanager
def only(*backends: SDPBackend) -> Iterator[None]:
    """torch's own switch: these backends, in this priority order."""
    with sdpa_kernel(list(backends), set_priority=True):
        yield


FLASH, EFFICIENT, CUDNN, MATH = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)


def test_sdpa_selection_follows_torchs_rules() -> None:
    """The default order on Hopper puts cuDNN first; each backend's refusals pass a call on
    to the next as sdp_utils.cpp's checks do."""
    assert sdpa_backend(H100, *_qkv(), is_causal=True) == ("cudnn", [])
    with only(FLASH, EFFICIENT, MATH):
        assert sdpa_backend(H100, *_qkv(), is_causal=True)[0] == "flash"
        backend, passed = sdpa_backend(H100, *_qkv(torch.float32), is_causal=True)
        assert backend == "efficient" and "float16 or bfloat16" in " ".join(passed)
        # DeepSeek-V3's attention: q/k head dim 192, v 128
        backend, passed = sdpa_backend(H100, *_qkv(d_qk=192, d_v=128), is_causal=True)
        assert backend == "efficient" and "equal head dims" in " ".join(passed)
        mask = torch.ones(128, 128, dtype=torch.bool, device="meta")
        assert sdpa_backend(H100, *_qkv(), attn_mask=mask)[0] == "efficient"
        gqa = _qkv(torch.float32, kv_heads=2)
        assert sdpa_backend(H100, *gqa, is_causal=True, enable_gqa=True)[0] == "math"
    assert sdpa_backend(H100, *_qkv(d_qk=192, d_v=128), is_causal=True)[0] == "cudnn"
    # cuDNN's backward on Hopper takes (192, 128) but not (160, 128)
    with only(CUDNN, MATH):
        assert sdpa_backend(H100, *_qkv(d_qk=160, d_v=128), is_causal=True)[0] == "math"
    with only(FLASH), pytest.raises(WorkbenchError, match="no attention kernel of NVIDIA H100"):
        sdpa_backend(H100, *_qkv(torch.float32))


def test_kernel_targets_resolve_by_mode() -> None:
    cpu = torch.device("cpu")
    assert resolve_kernels(None, "fake", cpu) == "h100"
    assert resolve_kernels("b200", "fake", cpu) == "b200"
    assert resolve_kernels(None, "real", cpu) == resolve_kernels("cpu", "real", cpu) == "cpu"
    with pytest.raises(WorkbenchError, match="real trace runs on its model's device"):
        resolve_kernels("h100", "real", cpu)
    with pytest.raises(WorkbenchError, match="choose cpu .* h100, h200, b200"):
        check_kernels("a100")


def test_gpu_kernels_dispatch_the_chosen_op_with_its_backward() -> None:
    q, k, v = _qkv()
    with gpu_kernels(H100) as record, only(EFFICIENT):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == q.shape and out.grad_fn is not None
    assert "ScaledDotProductEfficientAttentionBackward" in type(out.grad_fn).__name__
    [note] = record.notes()
    assert "aten._scaled_dot_product_efficient_attention" in note and "H100" in note


SMALL = {"layers": 2, "seq": 64, "batch": 2, "dtype": "bfloat16"}
B, H, S, D = 2, 16, 64, 16  # llama3-debug: dim 256, 16 heads
OUT, LSE = B * H * S * D * 2, B * H * S * 4  # bf16 output, fp32 log-sum-exp
# (torch's backend switch, the forward op, bytes saved per call beside output and lse: the
# philox seed and offset each kernel returns, u64)
GPU_CASES = {
    "cudnn": (CUDNN, "aten._scaled_dot_product_cudnn_attention.default", 8 + 8),
    "flash": (FLASH, "aten._scaled_dot_product_flash_attention.default", 16 + 8),
    "efficient": (EFFICIENT, "aten._scaled_dot_product_efficient_attention.default", 8 + 8),
}


def _gpu_graph(backend: SDPBackend) -> JointGraph:
    with only(backend):
        return trace(load_workload("llama3-debug", device="meta", **SMALL), "fake")


@pytest.fixture(scope="module")
def cpu_graph() -> JointGraph:
    return trace(load_workload("llama3-debug", device="meta", **SMALL), "fake", kernels="cpu")


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_attention_nodes_save_what_the_kernel_saves(case: str, cpu_graph: JointGraph) -> None:
    """Each GPU kernel in every layer, its backward op in backward; what it keeps for backward
    is its output and fp32 log-sum-exp plus its philox state, counted by hand; the estimates
    of the GPU- and CPU-shaped graphs differ by exactly those per-call extras."""
    backend, op, extra = GPU_CASES[case]
    graph = _gpu_graph(backend)
    assert graph.config["kernels"] == "h100" and graph.attention_counts() == {op: 2}
    backward = op.replace(".default", "_backward.default")
    assert sum(i.op == backward for i in graph.ops()) == 2
    policy = Policy("default")
    gpu, cpu = Estimator(graph).estimate(policy), Estimator(cpu_graph).estimate(policy)
    saved = {n: b for n, b in gpu.saved_by_node.items() if graph.nodes[n].op == op}
    assert list(saved.values()) == [OUT + LSE + extra] * 2
    cpu_op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert [b for n, b in cpu.saved_by_node.items() if cpu_graph.nodes[n].op == cpu_op] == [
        OUT + LSE
    ] * 2
    # beside attention, only the norms differ: CUDA's fused RMSNorm saves its input and an
    # fp32 rstd where the CPU's composite saves its own intermediates
    norms = {n: b for n, b in gpu.saved_by_node.items() if graph.nodes[n].module.endswith("norm")}
    cpu_norms = sum(
        b for n, b in cpu.saved_by_node.items() if cpu_graph.nodes[n].module.endswith("norm")
    )
    others = {n: b for n, b in gpu.saved_by_node.items() if n not in saved and n not in norms}
    assert sum(others.values()) == cpu.saved_activation_bytes - 2 * (OUT + LSE) - cpu_norms
    assert (
        gpu.saved_activation_bytes - cpu.saved_activation_bytes
        == 2 * extra + sum(norms.values()) - cpu_norms
    )
    assert any(case in note or op.split(".")[1] in note for note in graph.notes)


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_graphs_remat_as_the_whatif_says(case: str) -> None:
    graph = _gpu_graph(GPU_CASES[case][0])
    estimator = Estimator(graph)
    for preset in ("none", "default", "full", "titan-full"):
        policy = Policy(preset)
        assert estimator.estimate(policy).peak_bytes == (
            estimate_remat(graph, remat(graph, policy), estimator).peak_bytes
        )


class UnequalHeads(nn.Module):
    """Attention whose values are narrower than its queries and keys, as DeepSeek-V3's."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(64, 2 * 4 * 24, bias=False)
        self.v = nn.Linear(64, 4 * 16, bias=False)
        self.out = nn.Linear(4 * 16, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, 4, 24).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, s, 4, 16).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


def test_unequal_head_dims_take_cudnn_or_efficient_on_a_gpu_and_math_on_the_cpu() -> None:
    """The seq x seq scores the CPU's math path saves are gone from the GPU-shaped graph."""
    with torch.device("meta"):
        model = UnequalHeads().to(BF16)
    x = torch.empty(2, 128, 64, dtype=BF16, device="meta")
    workload = Workload(model, (x,), target=x, loss_fn=lambda out, t: (out - t).float().mean())
    graphs = {
        "h100": trace(workload, "fake"),
        "cpu": trace(workload, "fake", kernels="cpu"),
    }
    with only(FLASH, EFFICIENT, MATH):
        graphs["efficient"] = trace(workload, "fake")
    assert list(graphs["h100"].attention_counts()) == [
        "aten._scaled_dot_product_cudnn_attention.default"
    ]
    assert list(graphs["efficient"].attention_counts()) == [
        "aten._scaled_dot_product_efficient_attention.default"
    ]
    assert graphs["cpu"].attention_counts() == {}  # the math path: matmuls and a softmax
    saved = {
        k: Estimator(g).estimate(Policy("none")).saved_activation_bytes for k, g in graphs.items()
    }
    scores = 2 * 4 * 128 * 128 * 2  # one bf16 seq x seq score matrix (the math path keeps more)
    assert saved["cpu"] - saved["h100"] > scores
    assert abs(saved["efficient"] - saved["h100"]) < 64  # the same tensors, philox aside


@needs_torchtitan
def test_flex_attention_is_its_own_op_with_its_saved_tensors() -> None:
    """torchtitan's FlexAttention, traced for a GPU: the flex_attention op and its backward,
    its block mask as graph inputs, output and fp32 log-sum-exp saved; the CPU's kernels
    swap SDPA in as a real run does; what-if and remat agree."""
    workload = load_workload("torchtitan:llama3/debugmodel", device="meta", **SMALL)
    graph = trace(workload, "fake")
    assert graph.attention_counts() == {"flex_attention": 2}
    assert sum(i.op == "flex_attention_backward" for i in graph.ops()) == 2
    masks = [s.fqn for s in graph.inputs if s.fqn.startswith("attention_masks.")]
    assert "attention_masks.kv_num_blocks" in masks and len(masks) == 8
    assert any("FlexAttention as shipped" in note for note in graph.notes)
    attention = workload.model.config.layers[0].attention
    assert (attention.n_heads, attention.qkv_linear.head_dim) == (H, D)
    estimator = Estimator(graph)
    est = estimator.estimate(Policy("titan-default"))
    flex = [b for n, b in est.saved_by_node.items() if graph.nodes[n].op == "flex_attention"]
    assert flex == [OUT + LSE] * 2  # bf16 output + fp32 lse
    # its FLOPs: torch's formula for the op, at the tiles the block mask visits (all at S=64)
    from torch.utils.flop_counter import sdpa_flop_count

    forward = [i.flops for i in graph.ops() if i.op == "flex_attention"]
    assert forward == [sdpa_flop_count((B, H, S, D), (B, H, S, D), (B, H, S, D))] * 2
    for preset in ("titan-default", "titan-full", "default", "full"):
        policy = Policy(preset)
        assert estimator.estimate(policy).peak_bytes == (
            estimate_remat(graph, remat(graph, policy), estimator).peak_bytes
        )
    cpu = trace(workload, "fake", kernels="cpu")
    assert list(cpu.attention_counts()) == [
        "aten._scaled_dot_product_flash_attention_for_cpu.default"
    ]
    assert not any(s.fqn.startswith("attention_masks.") for s in cpu.inputs)


def test_trace_json_says_which_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    args = ["trace", "--model", "llama3-debug", "--mode", "fake", "--layers", "2", "--json"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["kernels"] == "h100"
    assert gpu["attention_ops"] == {"aten._scaled_dot_product_cudnn_attention.default": 2}
    assert any(note.startswith("kernels: traced for NVIDIA H100") for note in gpu["notes"])
    assert main([*args, "--kernels", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cpu["kernels"] == "cpu" and any("kernels='cpu'" in n for n in cpu["notes"])
    assert main([*args, "--kernels", "a100"]) == 2
    assert "unknown kernel target 'a100'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("batch", "seq", "block"),
    [(2, 512, 128), (3, 1024, 256), (2, 200, 128), (2, 64, 128), (1, 300, 128)],
)
def test_causal_block_mask_is_create_block_masks(batch: int, seq: int, block: int) -> None:
    """Built from block tables, the mask torch's create_block_mask makes by evaluating the
    causal mask everywhere: the same counts and, per row, the same blocks (a ragged last block
    included)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ours = causal_block_mask(batch, seq, block)
    torchs = create_block_mask(
        lambda b, h, q, kv: q >= kv, B=batch, H=None, Q_LEN=seq, KV_LEN=seq, BLOCK_SIZE=block
    )
    for side in ("kv", "full_kv", "q", "full_q"):
        counts = getattr(ours, f"{side}_num_blocks")
        assert counts.equal(getattr(torchs, f"{side}_num_blocks")), side

        def rows(mask: object, side: str = side, counts: torch.Tensor = counts) -> list[list[int]]:
            indices = getattr(mask, f"{side}_indices").flatten(0, 2)
            return [sorted(r[:c].tolist()) for r, c in zip(indices, counts.flatten(), strict=True)]

        assert rows(ours) == rows(torchs), side
    assert ours.to_dense().equal(torchs.to_dense())


def test_attention_flops_count_what_the_kernel_computes(cpu_graph: JointGraph) -> None:
    """torch's flop counter counts every (query, key) pair; a causal kernel computes (S + 1) /
    2S of them, flex attention the tiles its block mask visits (torch's `sparsity_hint`); the
    CPU's flash op, which torch's counter lacks, is counted as SDPA."""
    from torch.utils.flop_counter import sdpa_flop_count

    every_pair = sdpa_flop_count((B, H, S, D), (B, H, S, D), (B, H, S, D))
    causal = every_pair * (S + 1) // (2 * S)
    gpu = _gpu_graph(CUDNN)
    for graph in (gpu, cpu_graph):
        forward = [i.flops for i in graph.ops() if i.op in graph.attention_counts()]
        assert forward == [causal] * 2
    mask = causal_block_mask(B, S)  # 1 block of 128 x 128 at S = 64: all of it visited
    assert block_mask_sparsity(mask) == 0.0
    assert block_mask_sparsity(causal_block_mask(B, 512)) == 1 - 10 / 16


def test_rms_norm_fuses_where_torchs_cuda_rms_norm_does() -> None:
    """`rms_norm_symint` (layer_norm.cpp): fused unless complex, channels-last, or a weight
    of another dtype than the input's."""
    x = torch.empty(2, 8, 16, dtype=BF16, device="meta")
    assert fuses(x, torch.empty(16, dtype=BF16, device="meta")) and fuses(x, None)
    assert not fuses(x, torch.empty(16, device="meta"))  # fp32 weight, bf16 input
    assert not fuses(torch.empty(2, 8, 16, dtype=torch.complex64, device="meta"), None)
    image = torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last)
    assert not fuses(image, None)


def test_gpu_graphs_carry_cudas_fused_rms_norm_and_its_backward(cpu_graph: JointGraph) -> None:
    """Every norm of a GPU-shaped graph is the fused op, as `make_fx` records it on a GPU
    (tests/test_gpu_fixtures.py compares a whole step); it saves an fp32 rstd [B, S, 1]."""
    graph = trace(load_workload("llama3-debug", device="meta", **SMALL), "fake")
    norms = 2 * SMALL["layers"] + 1
    forward = [i for i in graph.ops() if i.op == FUSED_RMS_NORM]
    assert len(forward) == norms and all(i.phase == "forward" for i in forward)
    assert sum(i.op == "aten._fused_rms_norm_backward.default" for i in graph.ops()) == norms
    assert not any(i.op.startswith("workbench.") for i in graph.ops())
    assert {(i.shapes[1], i.dtype) for i in forward} == {((B, S, 1), "bfloat16")}
    rstd = graph.gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten._fused_rms_norm.default
    )
    assert {n.meta["val"][1].dtype for n in rstd} == {torch.float32}
    assert any(
        n.startswith(f"rms_norm: CUDA's fused kernel, {FUSED_RMS_NORM}") for n in graph.notes
    )
    assert not any(i.op == FUSED_RMS_NORM for i in cpu_graph.ops())


def test_the_stand_in_computes_torchs_rms_norm_on_a_cpu() -> None:
    """Forward only: its backward is the GPU's op, which a CPU build runs on fake tensors."""
    x, w = torch.randn(2, 8, 16), torch.randn(16)
    torch.testing.assert_close(fused_rms_norm(x, [16], w, 1e-6), torch.rms_norm(x, [16], w, 1e-6))
    torch.testing.assert_close(fused_rms_norm(x, [16]), torch.rms_norm(x, [16]))


def test_restore_names_the_stand_in_as_the_gpus_op() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: fused_rms_norm(x, [16]))(torch.randn(2, 16))
    assert restore_fused_rms_norm(gm) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] == (
        torch.ops.aten._fused_rms_norm.default
    )
    assert restore_fused_rms_norm(gm) == 0
