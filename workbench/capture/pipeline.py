"""(lead's placeholder until helper sched's module lands: schedule facts from torch)"""

from __future__ import annotations

from typing import Literal

from torch.distributed.pipelining import schedules

from workbench.errors import WorkbenchError

SCHEDULES: dict[str, type] = {
    name.removeprefix("Schedule"): cls
    for name, cls in vars(schedules).items()
    if name.startswith("Schedule") and isinstance(cls, type)
}


def schedule_class(name: str) -> type:
    key = {k.lower(): k for k in SCHEDULES}.get(name.lower().removeprefix("schedule"))
    if key is None:
        raise WorkbenchError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[key]


def stages_per_rank(name: str) -> int:
    return 2 if issubclass(schedule_class(name), schedules.PipelineScheduleMulti) else 1


def stage_style(name: str) -> Literal["loop", "v"]:
    return "v" if "V" in schedule_class(name).__name__.removeprefix("Schedule") else "loop"


def rank_stages(name: str, pp: int, rank: int) -> list[int]:
    per = stages_per_rank(name)
    if stage_style(name) == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per)]


from dataclasses import dataclass  # noqa: E402
from functools import cache  # noqa: E402
from types import SimpleNamespace  # noqa: E402


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    microbatch: int


@cache
def action_order(name: str, pp: int, microbatches: int) -> dict[int, list[Action]]:
    cls = schedule_class(name)
    per = stages_per_rank(name)
    n = pp * per
    stub = [
        SimpleNamespace(
            stage_index=s,
            num_stages=n,
            group_size=pp,
            group_rank=0,
            is_first=s == 0,
            is_last=s == n - 1,
            submod=None,
        )
        for s in rank_stages(name, pp, 0)
    ]
    sch = cls(stub if per > 1 else stub[0], n_microbatches=microbatches, loss_fn=lambda *a: None)
    out = {}
    for r, acts in sch.pipeline_order.items():
        row = []
        for a in acts:
            if a is None:
                continue
            for x in a.sub_actions or (a,):
                k = x.computation_type.value
                if k in ("F", "B", "I", "W"):
                    row.append(Action(x.stage_index, k, x.microbatch_index))
        out[r] = row
    return out
