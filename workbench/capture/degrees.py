"""How one job shards a train step: `Parallel(fsdp=, tp=, ep=, cp=)`, the degrees and mixed
precision the per-rank modules read (`parallel`, `param_shards`, `expert_parallel`), kept
apart so that they import it without importing one another.

Entry point: `Parallel` (re-exported by `workbench.capture.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from workbench.capture.models import DTYPES
from workbench.errors import WorkbenchError, check_int

__all__ = ["MAX_WORLD_SIZE", "DtypeName", "Parallel", "divisors"]

# torch's process groups count ranks in a C int; the largest jobs run ~10^5 GPUs.
MAX_WORLD_SIZE = 2**20
WORLD_WHY = "ranks in one job"
DtypeName = Literal["bfloat16", "float32"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel:
    """How one job shards a train step, as torchtitan runs it: FSDP x CP x TP ranks (EP
    borrows its ranks from them, as torchtitan's `ParallelDims` does), fp32 master shards
    cast to `param_dtype` before the all-gather, gradients reduce-scattered in
    `reduce_dtype`. CP runs through graph trainer's `parallelize` (torchtitan models), EP
    there and on the reference MoE (`workbench.capture.expert_parallel`)."""

    fsdp: int = 1
    """FSDP degree: ranks each parameter is sharded over (torchtitan's
    `parallelism.data_parallel_shard_degree`)."""

    tp: int = 1
    """Tensor-parallel degree (torchtitan's `parallelism.tensor_parallel_degree`)."""

    ep: int = 1
    """Expert-parallel degree: ranks the routed experts are split over, taken from the
    fsdp x cp x tp ranks (`parallelism.expert_parallel_degree`)."""

    cp: int = 1
    """Context-parallel degree (`parallelism.context_parallel_degree`)."""

    ep_imbalance: float = 1.0
    """Tokens this rank's experts receive per EP rank, as a multiple of the balanced count
    (fake tensors cannot route): 1 balanced, more for the hottest rank of a skewed router."""

    param_dtype: DtypeName = "bfloat16"
    """The dtype parameters are all-gathered and computed in (FSDP's mixed precision;
    torchtitan's `training.mixed_precision_param`)."""

    reduce_dtype: DtypeName = "float32"
    """The dtype gradients are reduce-scattered in (`training.mixed_precision_reduce`)."""

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp", "ep", "cp"):
            check_int(f"parallel {name}", getattr(self, name), 1, MAX_WORLD_SIZE, WORLD_WHY)
        world = self.fsdp * self.cp * self.tp
        check_int("parallel world size (fsdp x cp x tp)", world, 1, MAX_WORLD_SIZE, WORLD_WHY)
        shards = self.fsdp * self.cp * self.tp
        if shards % self.ep:
            raise WorkbenchError(
                f"--ep {self.ep} must divide fsdp x cp x tp = {shards} (expert parallelism "
                f"borrows its ranks from them, as in torchtitan): choose one of "
                f"{', '.join(str(d) for d in range(1, shards + 1) if shards % d == 0)}, or "
                f"e.g. --fsdp {self.ep} --ep {self.ep}"
            )
        imbalance = self.ep_imbalance
        if (
            isinstance(imbalance, bool)
            or not isinstance(imbalance, int | float)
            or not (1 <= imbalance <= self.ep)
        ):
            raise WorkbenchError(
                f"--ep-imbalance must be a number from 1 (balanced) to ep = {self.ep} (every "
                f"rank routes all its tokens here), got {imbalance!r}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise WorkbenchError(
                    f"parallel {name} {getattr(self, name)!r} is not one of {', '.join(DTYPES)}"
                )

    @property
    def world_size(self) -> int:
        return self.fsdp * self.cp * self.tp

    def describe(self) -> str:
        """`fsdp 2 x tp 2`, `fsdp 8 x ep 8`: fsdp and every degree above one."""
        degrees = {"fsdp": self.fsdp, "cp": self.cp, "tp": self.tp, "ep": self.ep}
        used = [f"{k} {v}" for k, v in degrees.items() if v > 1 or k == "fsdp"]
        return " x ".join(used)

    def to_json(self) -> dict[str, Any]:
        """ep and cp (and the imbalance) appear only when used: a 2-D job's JSON, and the
        keys derived from it, stay what they were."""
        extra: dict[str, Any] = {"cp": self.cp} if self.cp > 1 else {}
        if self.ep > 1:
            extra |= {"ep": self.ep, "ep_imbalance": self.ep_imbalance}
        return {
            "fsdp": self.fsdp,
            "tp": self.tp,
            **extra,
            "world_size": self.world_size,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
        }


def divisors(n: int) -> list[int]:
    """The degrees that split `n` ranks (or experts) evenly, smallest first.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]
