"""Parameters of one rank, the SimpleFSDP way: each replaced by its shard as a 2-D DTensor and
gathered in forward by a parametrization (`GatherParameter`), routed experts under EP on
the experts' ("efsdp", "ep") mesh.

Entry points: `shard_parameters(model, name, parallel, mesh, experts_mesh=None) ->
list[ParamShard]` (what `workbench.capture.parallel.shard_workload` calls), `tied_parameters`
and `retie` (tied weights through a TP plan), `clean_fqn`, `contiguous_stride`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from workbench.capture.expert_parallel import expert_shard
from workbench.capture.models import DTYPES
from workbench.capture.models.deepseek_v3 import GroupedExperts, MoE
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.capture.degrees import Parallel

__all__ = [
    "GatherParameter",
    "ParamShard",
    "clean_fqn",
    "contiguous_stride",
    "retie",
    "shard_parameters",
    "tied_parameters",
]


@dataclass(frozen=True)
class ParamShard:
    """Where one parameter's local shard sits: the state key functional_call swaps, the
    2-D placements, the global shape and whether they are on the experts' mesh."""

    fqn: str
    key: str
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    expert: bool = False


class GatherParameter(nn.Module):
    """FSDP in forward, the SimpleFSDP way: a parametrization turning the fsdp-sharded
    parameter into its tp-local whole. The cast to `param_dtype` comes before the
    all-gather (half the bytes on the wire); its backward reduce-scatters the gradient
    in `reduce_dtype`. Routed experts gather over `mesh["efsdp"]` (on `dim`); a parameter
    replicated over TP but used on sequence shards (`tp_partial`: the MoE's router and
    shared experts under EP) has its gradient all-reduced over TP."""

    def __init__(
        self,
        meshes: tuple[DeviceMesh, DeviceMesh],
        tp_placement: Placement | None,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        dim: int = 0,
        tp_partial: bool = False,
    ) -> None:
        super().__init__()
        self.fsdp_mesh, self.tp_mesh = meshes  # `mesh["fsdp"]`, `mesh["tp"]`
        self.tp_placement = tp_placement
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.dim, self.tp_partial = dim, tp_partial

    def forward(self, sharded: torch.Tensor) -> torch.Tensor:
        local = sharded.to_local() if isinstance(sharded, DTensor) else sharded
        on_fsdp = DTensor.from_local(local, self.fsdp_mesh, (Shard(self.dim),), run_check=False)
        whole = on_fsdp.redistribute(
            placements=(Replicate(),),
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        ).to_local(grad_placements=(Partial(),))
        if self.tp_partial:
            on_tp = DTensor.from_local(whole, self.tp_mesh, (Replicate(),), run_check=False)
            return on_tp.to_local(grad_placements=(Partial(),))
        if self.tp_placement is None:
            return whole
        return DTensor.from_local(whole, self.tp_mesh, (self.tp_placement,), run_check=False)


_PARAMETRIZED = re.compile(r"\.?parametrizations\.([^.]+)\.original$")


def clean_fqn(key: str) -> str:
    """`wq.parametrizations.weight.original` -> `wq.weight`: the name the user knows.

    >>> clean_fqn("layers.0.attention.wq.parametrizations.weight.original")
    'layers.0.attention.wq.weight'
    """
    return _PARAMETRIZED.sub(lambda m: ("." if m.start() else "") + m.group(1), key)


def tied_parameters(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """Parameters shared by several modules (tied embeddings), as (path, module, name)."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((path, module, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(tied: list[list[tuple[str, nn.Module, str]]], model_name: str) -> None:
    """parallelize_module gives each module its own DTensor parameter: tie them again
    when TP placed them alike, and refuse when it did not."""
    for (path, module, name), *others in tied:
        first = module._parameters[name]
        for other_path, other, other_name in others:
            param = other._parameters[other_name]
            if getattr(param, "placements", None) != getattr(first, "placements", None):
                raise WorkbenchError(
                    f"tied parameters {path}.{name} and {other_path}.{other_name} of "
                    f"{model_name!r} get different tensor-parallel placements; untie them "
                    "or give both modules the same sharding"
                )
            other._parameters[other_name] = first


def shard_parameters(
    model: nn.Module,
    name: str,
    parallel: Parallel,
    mesh: DeviceMesh,
    experts_mesh: DeviceMesh | None = None,
) -> list[ParamShard]:
    """Replace each parameter by its fsdp shard (of its tp shard) as a 2-D DTensor and
    register the gather; tied parameters stay tied. Under EP, routed experts are split over
    `experts_mesh` instead (`_shard_experts`)."""
    fsdp, rank = parallel.fsdp, mesh.get_local_rank("fsdp")
    meshes = (mesh["fsdp"], mesh["tp"])  # sliced once: a slice costs a millisecond
    done: dict[int, nn.Parameter] = {}
    gathers: dict[int, GatherParameter] = {}
    owners = [
        (path, module, pname, param)
        for path, module in model.named_modules()
        for pname, param in list(module._parameters.items())
        if param is not None
    ]
    # under EP with TP, the MoE routes its sequence shard with TP-replicated weights
    partial = {
        id(p)
        for m in model.modules()
        if isinstance(m, MoE) and experts_mesh is not None and parallel.tp > 1
        for p in m.parameters()
    }
    for path, module, pname, param in owners:
        if experts_mesh is not None and isinstance(module, GroupedExperts):
            done[id(param)], gathers[id(param)] = _shard_experts(param, parallel, experts_mesh)
        if id(param) not in done:
            tp_placement = param.placements[0] if isinstance(param, DTensor) else None
            local = param.to_local() if isinstance(param, DTensor) else param.detach()
            fqn = f"{path}.{pname}" if path else pname
            if local.dim() == 0 or local.shape[0] % fsdp:
                rows = local.shape[0] if local.dim() else "no"
                raise WorkbenchError(
                    f"--fsdp {fsdp} does not divide parameter {fqn} of {name!r} "
                    f"({rows} rows per tp rank, shape {tuple(local.shape)}); "
                    f"choose an fsdp that divides {rows}"
                )
            shard = local.chunk(fsdp, dim=0)[rank].clone()
            same_dim = isinstance(tp_placement, Shard) and tp_placement.dim == 0
            placements: tuple[Placement, ...] = (
                _StridedShard(0, split_factor=parallel.tp) if same_dim else Shard(0),
                tp_placement or Replicate(),
            )
            full_shape = param.shape
            dtensor = DTensor.from_local(
                shard,
                mesh,
                placements,
                run_check=False,
                shape=full_shape,
                stride=contiguous_stride(full_shape),
            )
            done[id(param)] = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            gathers[id(param)] = GatherParameter(
                meshes,
                tp_placement,
                DTYPES[parallel.param_dtype],
                DTYPES[parallel.reduce_dtype],
                tp_partial=id(param) in partial,
            )
        module._parameters[pname] = done[id(param)]
        parametrize.register_parametrization(module, pname, gathers[id(param)], unsafe=True)
    return [
        ParamShard(
            fqn=clean_fqn(key),
            key=key,
            placements=tuple(p.placements) if isinstance(p, DTensor) else (),
            shape=p.shape,
            stride=tuple(p.stride()),
            expert=isinstance(p, DTensor) and p.device_mesh is experts_mesh,
        )
        for key, p in model.named_parameters()
    ]


def _shard_experts(
    param: nn.Parameter, parallel: Parallel, mesh: DeviceMesh
) -> tuple[nn.Parameter, GatherParameter]:
    """A routed-expert weight as torchtitan shards it: its experts split over "ep", this
    rank's experts over "efsdp" (`expert_shard`); gathered over efsdp alone."""
    shard, dim = expert_shard(param, parallel, mesh)
    efsdp: Placement = _StridedShard(0, split_factor=parallel.ep) if dim == 0 else Shard(dim)
    shape = param.shape
    dtensor = DTensor.from_local(
        shard,
        mesh,
        (efsdp, Shard(0)),
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )
    gather = GatherParameter(
        (mesh["efsdp"], mesh["ep"]),
        None,
        DTYPES[parallel.param_dtype],
        DTYPES[parallel.reduce_dtype],
        dim=dim,
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad), gather


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a DTensor's global view).

    >>> contiguous_stride(torch.Size([8, 256, 128]))
    (32768, 128, 1)
    """
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))
