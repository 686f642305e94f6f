"""Which kernels a traced step carries: the CPU's, or the ones a target GPU would run.

A CPU-only torch traces `F.scaled_dot_product_attention` into the CPU's kernels (its flash
op, or the math path where head dims differ). Tracing for a GPU dispatches the op torch's
CUDA backend selection would pick (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`):
the GPU kernels' meta functions run on fake CPU tensors, and autograd records their own
backward ops, so the graph saves exactly what the GPU kernel saves.

Entry points: `KERNEL_TARGETS` (name -> `GpuArch`, plus `"cpu"`), `check_kernels(name)`,
`sdpa_backend(arch, query, key, value, ...)` (the rule) and `gpu_kernels(arch)` (the
dispatch while tracing, RMSNorm's too, with a record of what it chose).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from workbench.capture.gpu_norm import FUSED_RMS_NORM, fused_rms_norm, fuses
from workbench.errors import WorkbenchError

__all__ = [
    "ATTENTION_OPS",
    "CPU",
    "DEFAULT_GPU",
    "KERNEL_OPS",
    "KERNEL_TARGETS",
    "AttentionRecord",
    "ModelKernels",
    "GpuArch",
    "SdpaBackend",
    "check_kernels",
    "gpu_arch",
    "gpu_kernels",
    "kernels_note",
    "resolve_kernels",
    "sdpa_backend",
]

SdpaBackend = Literal["flash", "efficient", "cudnn", "math"]
CPU = "cpu"


@dataclass(frozen=True)
class GpuArch:
    """What torch's SDPA selection reads of a GPU: its compute capability, and whether its
    priority order puts cuDNN attention first (`check_prefer_cudnn_attention`: SM 9.x and
    10.x with cuDNN newer than 9.15, unless `TORCH_CUDNN_SDPA_DEPRIORITIZED=1`)."""

    name: str
    sm: tuple[int, int]
    cudnn_first: bool
    description: str


# The GPUs of the device profiles. torch 2.13's CUDA wheels ship cuDNN newer than 9.15, so
# its priority order on these parts is cuDNN, flash, efficient, math (sdp_utils.cpp,
# `priority_order`); on other setups `torch.backends.cuda.sdp_kernel` and
# `sdpa_kernel(..., set_priority=True)` change it, and the trace honours both.
KERNEL_TARGETS: dict[str, GpuArch] = {
    "h100": GpuArch("h100", (9, 0), True, "NVIDIA H100 (SM 9.0)"),
    "h200": GpuArch("h200", (9, 0), True, "NVIDIA H200 (SM 9.0)"),
    "b200": GpuArch("b200", (10, 0), True, "NVIDIA B200 (SM 10.0)"),
}

# torch's SDPBackend numbering (`torch.nn.attention.SDPBackend`): its priority order lists these.
_BACKEND_IDS: dict[int, SdpaBackend] = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
# torch's default priority order before the CUDA backend's first call may move cuDNN first.
_DEFAULT_ORDER = (1, 2, 0, 3, 4)


# What a fake-mode trace is traced for unless told otherwise (the default device profile's GPU).
DEFAULT_GPU = "h100"


def check_kernels(name: str) -> str:
    """`name` if it names a kernel target (`"cpu"` or a GPU), else one line listing them.

    >>> check_kernels("h100")
    'h100'
    """
    if name == CPU or name in KERNEL_TARGETS:
        return name
    raise WorkbenchError(
        f"unknown kernel target {name!r}; choose cpu (the kernels this CPU runs) or a GPU: "
        f"{', '.join(KERNEL_TARGETS)}"
    )


def gpu_arch(name: str) -> GpuArch | None:
    """The GPU a kernel target names; None for the CPU (and a real device's own kernels)."""
    return KERNEL_TARGETS.get(name)


def resolve_kernels(kernels: str | None, mode: str, device: torch.device) -> str:
    """The kernels a trace carries. Fake mode: the GPU asked for (`DEFAULT_GPU` by default),
    or `"cpu"`. Real mode: the workload's device's own (the graph runs there), so
    only that device's name (or None) is accepted.

    >>> cpu = torch.device("cpu")
    >>> resolve_kernels(None, "fake", cpu), resolve_kernels(None, "real", cpu)
    ('h100', 'cpu')
    """
    if mode == "real":
        own = torch.device(device).type
        if kernels not in (None, own):
            raise WorkbenchError(
                f"kernels={kernels!r} in real mode: a real trace runs on its model's device "
                f"({own}) with that device's kernels; trace with mode='fake' for {kernels} "
                f"kernels, or leave kernels unset"
            )
        return own
    return DEFAULT_GPU if kernels is None else check_kernels(kernels)


def kernels_note(kernels: str, mode: str) -> str:
    """What the graph's kernels are, for its notes."""
    arch = gpu_arch(kernels)
    if arch is not None:
        return (
            f"kernels: traced for {arch.description} on fake CPU tensors: attention runs that "
            "GPU's kernels (SDPA's as torch's CUDA selection picks them, sdp_utils.cpp; flex "
            "attention's own op), not the CPU's"
        )
    if mode == "real":
        return f"kernels: {kernels}'s own, as the real run on this machine executes them"
    return (
        "kernels: this CPU's (kernels='cpu'): CPU flash attention, tagged random and so "
        "always saved, and the math path where head dims differ; a GPU runs others"
    )


@dataclass(frozen=True)
class ModelKernels:
    """What a model's own kernel switch (`Workload.kernel_context`) did while traced: names for
    the tensors its kernels close over (`id(tensor) -> fqn`, lifted to graph inputs), what
    the nodes of some ops carry in `meta["custom"]` (op name -> entries: flex attention's
    `sparsity_hint`, which torch's flop counter reads) and notes saying what runs."""

    names: dict[int, str] = field(default_factory=dict)
    custom: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# --- the rule: torch's CUDA backend selection, as sdp_utils.cpp writes it --------------------


@dataclass(frozen=True)
class _Call:
    """What sdp_utils' checks read of one SDPA call."""

    dtype: torch.dtype
    batch: tuple[int, int, int]
    heads: tuple[int, int, int]
    seq_q: int
    seq_k: int
    d_qk: int
    d_v: int
    has_mask: bool
    dropout: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool


def _call(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> _Call:
    return _Call(
        dtype=q.dtype,
        batch=(q.shape[0], k.shape[0], v.shape[0]),
        heads=(q.shape[-3], k.shape[-3], v.shape[-3]),
        seq_q=q.shape[-2],
        seq_k=k.shape[-2],
        d_qk=q.shape[-1],
        d_v=v.shape[-1],
        has_mask=mask is not None,
        dropout=dropout,
        is_causal=causal,
        enable_gqa=gqa,
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    )


def _heads_ok(call: _Call) -> bool:
    """`check_batch_size_and_num_heads_dense` with GQA support (flash, efficient, cuDNN)."""
    q_heads, k_heads, v_heads = call.heads
    if len(set(call.batch)) != 1:
        return False
    if q_heads == k_heads == v_heads:
        return True
    return call.enable_gqa and k_heads == v_heads and q_heads % k_heads == 0


def _half(call: _Call) -> bool:
    return call.dtype in (torch.float16, torch.bfloat16)


def _flash_refusal(call: _Call, arch: GpuArch) -> str | None:
    """`can_use_flash_attention`: why flash cannot run the call, or None."""
    if call.has_mask:
        return "flash takes no attn_mask"
    if not (call.d_qk == call.d_v and call.d_qk <= 256):
        return f"flash needs equal head dims of at most 256 (q/k {call.d_qk}, v {call.d_v})"
    if not (8, 0) <= arch.sm <= (12, 1):
        return "flash needs SM 8.0 to 12.1"
    sm86_89_120 = (8, 6) <= arch.sm <= (8, 9) or (12, 0) <= arch.sm <= (12, 1)
    if sm86_89_120 and call.requires_grad and 192 < call.d_qk <= 224:
        return "flash has no backward for head dim in (192, 224] on this GPU"
    if call.is_causal and call.seq_q != call.seq_k:
        return "flash's is_causal needs seq_q == seq_k"
    if not _half(call):
        return f"flash needs float16 or bfloat16, not {call.dtype}"
    if not _heads_ok(call):
        return "flash needs equal batch and head counts (or GQA with enable_gqa)"
    return None


def _efficient_refusal(call: _Call, arch: GpuArch) -> str | None:
    """`can_use_mem_efficient_attention`: why the memory-efficient kernel cannot, or None."""
    if not (5, 0) <= arch.sm <= (12, 1):
        return "memory-efficient attention needs SM 5.0 to 12.1"
    # minimum_gemm_alignment: tensor cores on SM 8+, 128 bits per access
    alignment = 8 if _half(call) else 4
    aligned = call.d_qk % alignment == 0 and call.d_v % alignment == 0
    if not (aligned and call.d_qk > 0 and call.d_v > 0):
        return f"memory-efficient attention needs head dims divisible by {alignment}"
    if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"memory-efficient attention does not take {call.dtype}"
    if not _heads_ok(call):
        return "memory-efficient attention needs equal batch and head counts"
    if call.heads[0] != call.heads[1]:
        # its backward returns query-shaped key gradients (torch 2.13's autograd refuses
        # them), so a GQA call cannot be differentiated through it
        return "memory-efficient attention's backward has no GQA"
    return None


def _cudnn_refusal(call: _Call, arch: GpuArch) -> str | None:
    """`can_use_cudnn_attention` for a cuDNN newer than 9.22 (torch 2.13's wheels)."""
    if not _half(call):
        return f"cuDNN attention needs float16 or bfloat16, not {call.dtype}"
    if not (8, 0) <= arch.sm <= (12, 1):
        return "cuDNN attention needs SM 8.0 to 12.1"
    if call.dropout * 16 != math.floor(call.dropout * 16):
        return "cuDNN attention's dropout resolution is 1/16"
    if not _heads_ok(call):
        return "cuDNN attention needs equal batch and head counts (or GQA)"
    hopper_blackwell = arch.sm == (9, 0) or arch.sm[0] == 10
    limit = 256 if hopper_blackwell else 128
    if not (call.d_qk <= limit and call.d_v <= limit):
        return f"cuDNN attention takes head dims of at most {limit}"
    if call.d_qk % 8 or call.d_v % 8:
        return "cuDNN attention needs head dims divisible by 8"
    if call.seq_k == 1:
        return "cuDNN attention takes no key length 1"
    if hopper_blackwell and call.requires_grad:
        dims = (call.d_qk, call.d_v)
        if not (max(dims) <= 128 or dims in ((192, 128), (256, 256))):
            return f"cuDNN attention has no backward for head dims {dims} on this GPU"
    return None


_REFUSALS = {"flash": _flash_refusal, "efficient": _efficient_refusal, "cudnn": _cudnn_refusal}


def _enabled() -> dict[SdpaBackend, bool]:
    """torch's global switches (`sdpa_kernel` sets them; CPU builds keep them too)."""
    cuda = torch.backends.cuda
    return {
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def _order(arch: GpuArch) -> list[SdpaBackend]:
    """torch's priority order: the user's if they set one, else the default with cuDNN first
    where `check_prefer_cudnn_attention` holds."""
    ids = tuple(torch._C._get_sdp_priority_order())
    if ids == _DEFAULT_ORDER and arch.cudnn_first:
        ids = (3, 1, 2, 0)
    return [_BACKEND_IDS[i] for i in ids if i in _BACKEND_IDS]


def sdpa_backend(
    arch: GpuArch,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> tuple[SdpaBackend, list[str]]:
    """The kernel torch's `select_sdp_backend` runs the call with on `arch`, and why each
    backend before it in the priority order was passed over. The switches and priority order
    are torch's own (`torch.backends.cuda.*_sdp_enabled`, `sdpa_kernel`)."""
    call = _call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    enabled = _enabled()
    passed: list[str] = []
    for backend in _order(arch):
        if not enabled[backend]:
            passed.append(f"{backend} is disabled")
            continue
        if backend == "math":
            return backend, passed
        refusal = _REFUSALS[backend](call, arch)
        if refusal is None:
            return backend, passed
        passed.append(refusal)
    raise WorkbenchError(
        f"no attention kernel of {arch.description} runs this call ({'; '.join(passed)}); "
        "enable the math backend (torch.nn.attention.sdpa_kernel)"
    )


# --- the dispatch while tracing ------------------------------------------------------------


@dataclass
class AttentionRecord:
    """What `gpu_kernels` chose: per (backend, call shapes) traced, why the backends before
    it in the priority order were passed over."""

    arch: GpuArch
    chosen: dict[tuple[SdpaBackend, str], list[str]] = field(default_factory=dict)
    # `rms_norm` calls traced as CUDA's fused kernel, and as the composite (`gpu_norm.fuses`)
    fused_norms: int = 0
    composite_norms: int = 0

    def notes(self) -> list[str]:
        """One line per kernel and call shape, for the graph's notes."""
        lines = []
        if self.fused_norms:
            lines.append(
                f"rms_norm: CUDA's fused kernel, {FUSED_RMS_NORM} and its backward, as "
                "torch's rms_norm dispatches it on a GPU (layer_norm.cpp, rms_norm_symint)"
            )
        if self.composite_norms:
            lines.append(
                "rms_norm: the composite where torch's CUDA rms_norm falls back to it "
                "(complex, channels-last, or a weight of another dtype than the input's)"
            )
        for (backend, shapes), passed in sorted(self.chosen.items()):
            why = "; ".join(passed) or "first in torch's priority order"
            lines.append(
                f"attention: {KERNEL_OPS[backend]} ({shapes}), as torch's SDPA selection "
                f"picks it on {self.arch.description} ({why})"
            )
        return lines


# The forward op each backend runs (its backward op is `..._backward`).
KERNEL_OPS: dict[SdpaBackend, str] = {
    "flash": "aten._scaled_dot_product_flash_attention",
    "efficient": "aten._scaled_dot_product_efficient_attention",
    "cudnn": "aten._scaled_dot_product_cudnn_attention",
    "math": "aten._scaled_dot_product_attention_math",
}
# Every attention kernel a trace may hold, by op name: the GPU's, the CPU's flash op and
# flex attention's (`workbench.capture.graph.JointGraph.summary` counts them).
ATTENTION_OPS: frozenset[str] = frozenset(
    {
        *(f"{op}.default" for op in KERNEL_OPS.values()),
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "flex_attention",
    }
)


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`convert_boolean_attn_mask`: a boolean mask becomes 0 / -inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(
        mask.logical_not(), -math.inf
    )


def _padded_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`preprocess_mask` of the memory-efficient path: expanded to 4-D, the key dimension
    padded to a multiple of 16 (the padding sliced off again: a view of a bigger tensor)."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    pad = -mask.shape[-1] % 16
    if pad:
        return F.pad(mask, (0, pad))[..., : mask.shape[-1] - pad or None]
    return mask


def _pad8(t: torch.Tensor) -> torch.Tensor:
    """`pad_last_dim<8>`: the CUDA flash path pads head dims to a multiple of 8."""
    pad = -t.shape[-1] % 8
    return F.pad(t, (0, pad)) if pad else t


def _dispatch(backend: SdpaBackend, args: tuple[Any, ...], kw: dict[str, Any]) -> torch.Tensor:
    """The CUDA branch of `scaled_dot_product_attention` (attention.cpp) for `backend`."""
    aten = torch.ops.aten
    q, k, v = args[:3]
    mask = kw.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = float(kw.get("dropout_p", args[4] if len(args) > 4 else 0.0))
    causal = bool(kw.get("is_causal", args[5] if len(args) > 5 else False))
    scale = kw.get("scale", args[6] if len(args) > 6 else None)
    gqa = bool(kw.get("enable_gqa", args[7] if len(args) > 7 else False))
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if backend == "flash":
        head = q.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(head)
        out = aten._scaled_dot_product_flash_attention(
            _pad8(q), _pad8(k), _pad8(v), dropout, causal, False, scale=scale
        )[0]
        return out[..., :head] if out.shape[-1] != head else out
    if backend == "efficient":
        bias = _float_mask(mask, q.dtype)
        bias = _padded_bias(bias, q, k) if bias is not None else None
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, lse, dropout, causal, scale=scale
        )[0]
    if backend == "cudnn":
        bias = _float_mask(mask, q.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, lse, dropout, causal, False, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        q, k, v, _float_mask(mask, q.dtype), dropout, causal, None, scale=scale, enable_gqa=gqa
    )[0]


_RMS_NORMS = (F.rms_norm, torch.rms_norm)


class _GpuKernels(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to the kernel `sdpa_backend` picks, and
    `rms_norm` to CUDA's fused kernel where torch's rule fuses it."""

    def __init__(self, record: AttentionRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RMS_NORMS:
            return self._rms_norm(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        backend, passed = sdpa_backend(
            self.record.arch,
            q,
            k,
            v,
            kwargs.get("attn_mask", args[3] if len(args) > 3 else None),
            float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)),
            bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False)),
            bool(kwargs.get("enable_gqa", args[7] if len(args) > 7 else False)),
        )
        shapes = f"q/k {tuple(q.shape)}, v {tuple(v.shape)}, {str(q.dtype).removeprefix('torch.')}"
        self.record.chosen.setdefault((backend, shapes), passed)
        return _dispatch(backend, args, kwargs)

    def _rms_norm(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "normalized_shape", "weight", "eps")
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        bound.setdefault("weight", None)
        bound.setdefault("eps", None)
        if not fuses(bound["input"], bound["weight"]):
            self.record.composite_norms += 1
            return func(*args, **kwargs)
        self.record.fused_norms += 1
        return fused_rms_norm(**bound)


@contextlib.contextmanager
def gpu_kernels(arch: GpuArch) -> Iterator[AttentionRecord]:
    """While tracing: every `F.scaled_dot_product_attention` runs the kernel torch would pick
    on `arch` (its meta function on fake CPU tensors) and every `rms_norm` CUDA's fused kernel
    where torch fuses it (`workbench.capture.gpu_norm`); yields the record of what it chose."""
    record = AttentionRecord(arch)
    with _GpuKernels(record):
        yield record
