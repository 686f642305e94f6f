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
