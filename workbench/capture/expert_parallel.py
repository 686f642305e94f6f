"""Expert parallelism for the reference MoE (`models.deepseek_v3.MoE`): routed experts split
over `ep` ranks, token copies sent to them and back by all-to-alls, as torchtitan's
`AllToAllTokenDispatcher` runs them, with the static token counts a fake trace needs.

Entry points: `check_expert_parallel(workload, parallel)`, `expert_mesh(parallel)` (the
("efsdp", "ep") mesh), `expert_shard(param, parallel, mesh)` (a rank's slice of a
routed-expert weight), `ExpertDispatch` (set on each MoE by `apply_expert_parallel`), and
the token counts shared with torchtitan models: `ep_token_splits`, `routing_note`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.capture.degrees import EXPERT_MESH_DIMS, divisors
from workbench.capture.models.deepseek_v3 import GroupedExperts, MoE
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.capture.degrees import Parallel

__all__ = [
    "EXPERT_MESH_DIMS",
    "ExpertDispatch",
    "apply_expert_parallel",
    "check_expert_parallel",
    "ep_token_splits",
    "expert_mesh",
    "expert_shard",
    "routing_note",
]


def check_expert_parallel(workload: Workload, parallel: Parallel) -> None:
    """Refuse, in one line, `--ep` on a model without routed experts, an ep that does not
    divide them, and an expert FSDP degree that divides no dimension of an expert's weights.
    (That ep divides the ranks it borrows is `Parallel`'s own check.) A pipeline stage of an
    MoE model holding dense layers only is accepted: EP has nothing to split there."""
    if parallel.ep == 1:
        return
    config = getattr(workload.model, "moe_config", None)
    if config is None:
        raise WorkbenchError(
            f"--ep {parallel.ep}: {workload.name!r} has no routed experts (no MoE layers); "
            "expert parallelism needs an MoE model such as dsv3-debug or dsv3-16b; use --ep 1"
        )
    experts = int(config.n_experts)
    if experts % parallel.ep:
        valid = [d for d in divisors(experts) if parallel.world_size % d == 0]
        raise WorkbenchError(
            f"--ep {parallel.ep} does not divide the {experts} routed experts of "
            f"{workload.name!r}; choose an ep dividing both {experts} and fsdp x cp x tp = "
            f"{parallel.world_size}: {', '.join(map(str, valid))}"
        )
    efsdp = parallel.efsdp
    dim = _efsdp_dim(parallel, experts)
    # w1, w3: (experts, dim, hidden); w2: (experts, hidden, dim)
    sizes = [experts // parallel.ep] if dim == 0 else [config.dim, config.expert_hidden]
    for size in sizes:
        if size % efsdp:
            raise WorkbenchError(
                f"--ep {parallel.ep} leaves expert FSDP over {efsdp} ranks (fsdp x cp x tp / "
                f"ep), which does not divide dimension {dim} ({size}) of {workload.name!r}'s "
                f"routed-expert weights; choose an ep that leaves a divisor of {size}"
            )


def _efsdp_dim(parallel: Parallel, experts: int) -> int:
    """torchtitan's `apply_simple_fsdp`: experts' FSDP splits the local experts (dim 0), or
    dim 1 when there are fewer of them than efsdp ranks."""
    return 1 if parallel.efsdp * parallel.ep > experts else 0


def expert_mesh(parallel: Parallel, device_type: str = "cpu") -> DeviceMesh:
    """The ("efsdp", "ep") mesh over the initialised process group: EP borrows consecutive
    ranks of the fsdp x cp x tp ones (tp innermost), efsdp spans the rest, as torchtitan's
    `ParallelDims` unflattens its sparse mesh."""
    sizes = parallel.mesh_sizes()
    shape = tuple(sizes[dim] for dim in EXPERT_MESH_DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def expert_shard(param: torch.Tensor, parallel: Parallel, mesh: DeviceMesh) -> tuple[Any, int]:
    """This rank's shard of a stacked routed-expert weight (experts, ., .) on the experts'
    `mesh`: its `n / ep` experts, then its efsdp slice of them (on the dimension
    `_efsdp_dim` picks), with that dimension. Sizes are checked by `check_expert_parallel`."""
    local = param.detach().chunk(parallel.ep, dim=0)[mesh.get_local_rank("ep")]
    dim = _efsdp_dim(parallel, param.shape[0])
    return local.chunk(parallel.efsdp, dim=dim)[mesh.get_local_rank("efsdp")].clone(), dim


def ep_token_splits(sent: int, ep: int, imbalance: float) -> tuple[list[int], list[int]]:
    """The static sizes of an EP dispatch that fake tensors cannot route: `sent` token
    copies go evenly to the `ep` ranks (what a balanced router does) and `imbalance` x the
    balanced count comes back from each (1: balanced; more: this rank's experts are the
    hottest), at most all of a sender's copies.

    >>> ep_token_splits(10, 4, 1.0), ep_token_splits(8, 4, 1.5)
    (([3, 3, 2, 2], [3, 3, 2, 2]), ([2, 2, 2, 2], [3, 3, 3, 3]))
    """
    base, extra = divmod(sent, ep)
    balanced = [base + (i < extra) for i in range(ep)]
    return balanced, [min(sent, math.ceil(imbalance * n)) for n in balanced]


def routing_note(exchanges: str, imbalance: float, ep: int | None = None) -> str:
    """What the graph binds about routing, in the note every EP graph carries; `exchanges`
    says how many dispatches there are (`3 here`, `one per MoE layer`), `ep` the EP ranks
    (None: layouts of several degrees, as a plan's).

    >>> print(routing_note("3 here", 1.5, 4))
    expert routing: fake tensors cannot route, so each EP dispatch all-to-all (3 here) sends ...
    the 4 EP ranks and receives 1.5 x the balanced count ... (ep_imbalance 1.5; 1 = balanced)
    """
    ranks = f"{ep} EP ranks" if ep is not None else "EP ranks"
    return (
        f"expert routing: fake tensors cannot route, so each EP dispatch all-to-all "
        f"({exchanges}) sends its routed token copies evenly to the {ranks} and receives "
        f"{imbalance:g} x the balanced count from each (ep_imbalance {imbalance:g}; "
        "1 = balanced)"
    )


def _exchange(x: torch.Tensor, output: list[int], input: list[int], group: str) -> torch.Tensor:
    """One functional all-to-all and its wait (what make_fx records as two nodes)."""
    sent = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), output, input, group)
    return torch.ops._c10d_functional.wait_tensor(sent)


class _AllToAll(torch.autograd.Function):
    """A token all-to-all whose gradient goes back by the reverse all-to-all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, output: list[int], input: list[int], group: str
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output, input), group
        return _exchange(x, output, input, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        output, input = ctx.splits
        return _exchange(grad, input, output, ctx.group), None, None, None


@dataclass(frozen=True)
class ExpertDispatch:
    """How one MoE reaches its experts over EP (torchtitan's dispatch, experts, combine):
    the per-expert token counts are exchanged (no gradient), the routed token copies go to
    the experts' ranks by an all-to-all with `ep_token_splits`' static sizes, this rank's
    experts run `torch._grouped_mm` on what arrives, and a second all-to-all brings the
    outputs back. torchtitan also reorders what arrives from rank-major to expert-major (a
    row gather); the reference does not, nor does it drop tokens."""

    group: str
    """The "ep" mesh dimension's process group name."""
    ep: int
    imbalance: float

    def __call__(
        self, experts: GroupedExperts, routed: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        send, receive = ep_token_splits(int(routed.shape[0]), self.ep, self.imbalance)
        arrived = sum(receive)
        with torch.no_grad():
            equal = [counts.numel() // self.ep] * self.ep
            per_rank = _exchange(counts, equal, equal, self.group)
            local = per_rank.view(self.ep, -1).sum(0)
            # counts of a fake group are not a router's: keep the offsets within what arrives
            offsets = local.cumsum(0).clamp(0, arrived).to(torch.int32)
        received = _AllToAll.apply(routed, receive, send, self.group)
        return _AllToAll.apply(experts(received, offsets), send, receive, self.group)  # type: ignore[no-any-return]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, parallel: Parallel) -> int:
    """Give every MoE of `model` (a copy being sharded) an `ExpertDispatch` over `mesh`'s
    "ep" dimension; returns how many."""
    dispatch = ExpertDispatch(mesh["ep"].get_group().group_name, parallel.ep, parallel.ep_imbalance)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.dispatch = dispatch
    return len(moes)
