"""How one job splits its ranks: `Degrees` (dp, fsdp, cp, tp, pp, ep), the one value that
capture, cost, search and the command line read, and `Parallel` (the degrees plus the mixed
precision and routing skew the per-rank modules read: `parallel`, `param_shards`,
`expert_parallel`), kept apart so that they import it without importing one another.

Entry points: `Degrees`, `Parallel` (re-exported by `workbench.capture.parallel`), `DEGREES`,
`MESH_DIMS`, `EXPERT_MESH_DIMS`, `divisors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from workbench.errors import WorkbenchError, check_int

__all__ = [
    "DEGREES",
    "EXPERT_MESH_DIMS",
    "MAX_WORLD_SIZE",
    "MESH_DIMS",
    "Degrees",
    "DtypeName",
    "Parallel",
    "divisors",
]

# torch's process groups count ranks in a C int; the largest jobs run ~10^5 GPUs.
MAX_WORLD_SIZE = 2**20
WORLD_WHY = "ranks in one job"
DtypeName = Literal["float32", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)
# The meshes the workbench builds, as torchtitan's `ParallelDims` does: the dense one with tp
# innermost (cp > 1 only through graph trainer's `parallelize`; the reference models' mesh is
# ("fsdp", "tp")), and the same ranks unflattened for routed experts, ep innermost.
MESH_DIMS = ("fsdp", "cp", "tp")
EXPERT_MESH_DIMS = ("efsdp", "ep")


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class Degrees:
    """How many ranks each kind of parallelism spans, as torchtitan's `ParallelDims` counts
    them. One pipeline rank's graph is sharded over dp x fsdp x cp x tp ranks (`world_size`);
    pp such groups run the pipeline's stages (`gpus` in all); EP borrows its ranks from the
    fsdp x cp x tp ones. Adding a kind of parallelism is adding a field here and the code
    that shards by it. Ordered as tuples of the fields (to sort layouts by)."""

    dp: int = 1
    """Replicas: data-parallel ranks holding whole parameters (torchtitan's
    `parallelism.data_parallel_replicate_degree`, the mesh dimension outside fsdp). Each
    replica's rank traces the same graph; `Parallel` traces none yet."""

    fsdp: int = 1
    """FSDP degree: ranks each parameter is sharded over (torchtitan's
    `parallelism.data_parallel_shard_degree`); mesh dimension "fsdp"."""

    cp: int = 1
    """Context-parallel degree: ranks each sequence is split over
    (`parallelism.context_parallel_degree`); mesh dimension "cp"."""

    tp: int = 1
    """Tensor-parallel degree (`parallelism.tensor_parallel_degree`); mesh dimension "tp",
    innermost."""

    pp: int = 1
    """Pipeline-parallel degree: ranks the layers are split over in stages
    (`parallelism.pipeline_parallel_degree`; `workbench.capture.stages.Pipeline` holds the
    schedule and the microbatches)."""

    ep: int = 1
    """Expert-parallel degree: ranks the routed experts are split over, taken from the
    fsdp x cp x tp ranks (`parallelism.expert_parallel_degree`); mesh dimension "ep" of the
    experts' mesh, whose "efsdp" spans the ranks it leaves."""

    def __post_init__(self) -> None:
        for name in DEGREES:
            check_int(f"parallel {name}", getattr(self, name), 1, MAX_WORLD_SIZE, WORLD_WHY)
        factors = " x ".join(n for n in ("dp", *MESH_DIMS) if n != "dp" or self.dp > 1)
        check_int(f"parallel world size ({factors})", self.world_size, 1, MAX_WORLD_SIZE, WORLD_WHY)
        shards = self.fsdp * self.cp * self.tp
        if shards % self.ep:
            raise WorkbenchError(
                f"--ep {self.ep} must divide fsdp x cp x tp = {shards} (expert parallelism "
                f"borrows its ranks from them, as in torchtitan): choose one of "
                f"{', '.join(map(str, divisors(shards)))}, or e.g. --fsdp {self.ep} --ep {self.ep}"
            )

    @property
    def world_size(self) -> int:
        """The ranks one pipeline rank's graph is sharded over, dp x fsdp x cp x tp: the
        process group it is traced on and a graph's `world_size` (every GPU when pp is 1)."""
        return self.dp * self.fsdp * self.cp * self.tp

    @property
    def gpus(self) -> int:
        """Every rank of the job: `world_size` x pp (torchtitan's `world_size`)."""
        return self.world_size * self.pp

    @property
    def sharded(self) -> bool:
        """Whether a rank's graph is sharded: a degree but pp above one (else one rank holds
        the whole model, or a whole stage of it)."""
        return any(v > 1 for k, v in self.used(()).items() if k != "pp")

    @property
    def efsdp(self) -> int:
        """Ranks the routed experts' FSDP spans: the fsdp x cp x tp ranks EP leaves."""
        return self.fsdp * self.cp * self.tp // self.ep

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks sharing one rank's tokens, cp x tp x pp (torchtitan's name): what tokens/s
        per GPU divides a rank's tokens/s by."""
        return self.cp * self.tp * self.pp

    def mesh_sizes(self) -> dict[str, int]:
        """Each mesh dimension's ranks (`MESH_DIMS`, then `EXPERT_MESH_DIMS`).

        >>> Degrees(fsdp=4, tp=2, ep=4).mesh_sizes()
        {'fsdp': 4, 'cp': 1, 'tp': 2, 'efsdp': 2, 'ep': 4}
        """
        return {"fsdp": self.fsdp, "cp": self.cp, "tp": self.tp, "efsdp": self.efsdp, "ep": self.ep}

    def consecutive_ranks(self, mesh_dim: str | None) -> int:
        """The consecutive ranks a group of `mesh_dim` strides over, the innermost dimension
        first (tp: tp, cp: cp x tp, ep: ep); fsdp, efsdp and the world (None): the world.

        >>> d = Degrees(fsdp=8, cp=2, tp=4, ep=8)
        >>> d.consecutive_ranks("tp"), d.consecutive_ranks("cp"), d.consecutive_ranks("fsdp")
        (4, 8, 64)
        """
        strides = {"tp": self.tp, "cp": self.cp * self.tp, "ep": self.ep}
        return strides.get(mesh_dim or "", self.world_size)

    def used(self, always: tuple[str, ...] = ("fsdp",)) -> dict[str, int]:
        """The degrees in `always`, in that order, then every other above one.

        >>> Degrees(fsdp=8, ep=8).used(), Degrees(tp=2).used(("fsdp", "tp", "pp"))
        ({'fsdp': 8, 'ep': 8}, {'fsdp': 1, 'tp': 2, 'pp': 1})
        """
        shown = {name: getattr(self, name) for name in always}
        return shown | {
            n: getattr(self, n) for n in DEGREES if n not in shown and getattr(self, n) > 1
        }

    def describe(self, always: tuple[str, ...] = ("fsdp",)) -> str:
        """`fsdp 2 x tp 2`, `fsdp 8 x ep 8`: the degrees `used` shows.

        >>> Degrees(fsdp=8, ep=8).describe(), Degrees(fsdp=4).describe(("fsdp", "tp", "pp"))
        ('fsdp 8 x ep 8', 'fsdp 4 x tp 1 x pp 1')
        """
        return " x ".join(f"{k} {v}" for k, v in self.used(always).items())

    def to_json(self) -> dict[str, Any]:
        """fsdp and tp, every other degree above one, and `world_size`: a 2-D job's JSON,
        and the keys derived from it, stay what they were."""
        return {**self.used(("fsdp", "tp")), "world_size": self.world_size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Degrees:
        """The degrees a JSON object names (a graph's `config`, `to_json`'s output), 1 where
        it names none; pp, when absent, from its `pipeline` (a stage graph's config).

        >>> Degrees.from_json({"fsdp": 2, "tp": 2, "world_size": 4, "seq": 32})
        Degrees(dp=1, fsdp=2, cp=1, tp=2, pp=1, ep=1)
        """
        found = {name: int(data[name]) for name in DEGREES if name in data}
        pipeline = data.get("pipeline")
        if "pp" not in found and isinstance(pipeline, Mapping) and "pp" in pipeline:
            found["pp"] = int(pipeline["pp"])
        return cls(**found)

    def degrees(self) -> Degrees:
        """The degrees alone (a `Parallel` less its precision and routing)."""
        return Degrees(**{name: getattr(self, name) for name in DEGREES})


DEGREES: tuple[str, ...] = tuple(f.name for f in fields(Degrees))


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel(Degrees):
    """How one rank's graph is sharded, as torchtitan runs it: its `Degrees` (FSDP x CP x TP
    ranks, EP borrowing from them), fp32 master shards cast to `param_dtype` before the
    all-gather, gradients reduce-scattered in `reduce_dtype`. CP runs through graph
    trainer's `parallelize` (torchtitan models), EP there and on the reference MoE
    (`workbench.capture.expert_parallel`). pp is the pipeline's (`trace_stages` traces its
    stages); dp (replicas) is not traced yet."""

    ep_imbalance: float = 1.0
    """Tokens this rank's experts receive per EP rank, as a multiple of the balanced count
    (fake tensors cannot route): 1 balanced, more for the hottest rank of a skewed router."""

    param_dtype: DtypeName = "bfloat16"
    """The dtype parameters are all-gathered and computed in (FSDP's mixed precision;
    torchtitan's `training.mixed_precision_param`)."""

    reduce_dtype: DtypeName = "float32"
    """The dtype gradients are reduce-scattered in (`training.mixed_precision_reduce`)."""

    def __post_init__(self) -> None:
        Degrees.__post_init__(self)  # `super()` fails in a slots dataclass's methods
        if self.dp > 1:
            raise WorkbenchError(
                f"parallel dp {self.dp}: the workbench traces no replicated data parallelism "
                "(HSDP) yet; shard parameters over those ranks with fsdp instead"
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
            value = getattr(self, name)
            if value not in DTYPE_NAMES:
                raise WorkbenchError(
                    f"parallel {name} {value!r} is not one of {', '.join(DTYPE_NAMES)}"
                )

    @classmethod
    def of(cls, degrees: Degrees, **options: Any) -> Parallel:
        """A `Parallel` of `degrees`, with `options` (`ep_imbalance`, the dtypes)."""
        return cls(**{name: getattr(degrees, name) for name in DEGREES}, **options)

    def to_json(self) -> dict[str, Any]:
        """The degrees' JSON less pp (a stage graph's `pipeline` holds it), the imbalance
        after ep when EP is used, and the dtypes."""
        degrees = Degrees.to_json(self)
        degrees.pop("pp", None)
        world = degrees.pop("world_size")
        extra = {"ep_imbalance": self.ep_imbalance} if self.ep > 1 else {}
        return {
            **degrees,
            **extra,
            "world_size": world,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
        }


def divisors(n: int) -> list[int]:
    """The degrees that split `n` ranks (or experts) evenly, smallest first.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]
