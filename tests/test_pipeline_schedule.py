"""Pipeline schedules: torch's action orders against orders written out by hand and torch's own
dry run, and the memory and time simulation over them worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from workbench.capture.pipeline import (
    SCHEDULES,
    Action,
    action_order,
    check_microbatches,
    check_order,
    rank_stages,
    schedule_class,
    stage_ranks,
    stage_style,
    stages_per_rank,
)
from workbench.cost.schedule import PhaseCost, ScheduleWalk, StageCost, simulate
from workbench.errors import WorkbenchError


def actions(text: str) -> list[Action]:
    return [Action.from_str(word) for word in text.split()]


def written(order: dict[int, list[Action]]) -> dict[int, str]:
    return {rank: " ".join(map(str, acts)) for rank, acts in order.items()}


def stage(
    s: int, *, resident: int = 0, grads: int = 0, send: int = 0, **phases: PhaseCost
) -> StageCost:
    return StageCost(s, resident, grads, dict(phases), send_bytes=send)


# --- the orders ---------------------------------------------------------------------------


def test_1f1b_two_ranks_four_microbatches_as_written_by_hand() -> None:
    # Rank 0 warms up with two forwards, then one backward per forward; the last rank
    # alternates from the start (torch's `Schedule1F1B._step_microbatches`).
    assert action_order("1F1B", 2, 4) == {
        0: actions("0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"),
        1: actions("1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"),
    }


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    assert action_order("GPipe", 2, 3) == {
        0: actions("0F0 0F1 0F2 0B0 0B1 0B2"),
        1: actions("1F0 1F1 1F2 1B0 1B1 1B2"),
    }


class _Recorder(SimpleNamespace):
    """A stand-in stage for torch's single-stage runtime: records what it is asked to run,
    sends and receives nothing."""

    def get_fwd_recv_ops(self, mb: int) -> list[object]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args: object, **kwargs: object) -> None:
        self.ran.append(Action(self.stage_index, "F", mb))

    def backward_one_chunk(self, mb: int, **kwargs: object) -> None:
        self.ran.append(Action(self.stage_index, "B", mb))

    def perform_reduce_grad(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 6), (3, 3)])
def test_single_stage_orders_are_what_torchs_runtime_runs(
    name: str, pp: int, microbatches: int
) -> None:
    """Single-stage schedules run `_step_microbatches`, not their `pipeline_order`: run it
    on stand-in stages that record each forward and backward."""
    for rank in range(pp):
        stage = _Recorder(
            stage_index=rank,
            num_stages=pp,
            group_size=pp,
            group_rank=rank,
            is_first=rank == 0,
            is_last=rank == pp - 1,
            submod=None,
            ran=[],
        )
        schedule = schedule_class(name)(stage, microbatches, loss_fn=lambda *a: None)
        schedule._initialize_stage = lambda *args, **kwargs: None
        schedule._step_microbatches(target_mbs=[None] * microbatches)
        assert stage.ran == action_order(name, pp, microbatches)[rank]


def test_torch_1f1b_order_still_numbers_the_last_ranks_forwards_from_one() -> None:
    """The reason `action_order` renumbers: torch's runtime lowering (sends and receives
    added) refuses its raw order and takes ours. When this fails, torch fixed it: drop
    `_forwards_from_one`."""
    stand_in = SimpleNamespace(
        stage_index=0, num_stages=2, group_size=2, group_rank=0, is_first=True, is_last=False
    )
    raw = torch_schedules.Schedule1F1B(stand_in, 4, loss_fn=lambda *a: None).pipeline_order
    assert raw is not None and [str(a) for a in raw[1] if a is not None][0] == "1F1"
    with pytest.raises(AssertionError, match="can't schedule sends/recvs"):
        torch_schedules._add_send_recv(raw, lambda s: s, 2)
    _torch_dry_run(action_order("1F1B", 2, 4), {0: 0, 1: 1})


def _torch_dry_run(order: dict[int, list[Action]], ranks: dict[int, int]) -> None:
    """torch lowers the order as its runtime does (sends and receives added), then runs its
    dry run over it; either raises on an order that would hang."""
    compute = {
        rank: [
            torch_schedules._Action(a.stage, torch_schedules._ComputationType(a.kind), a.microbatch)
            for a in acts
        ]
        for rank, acts in order.items()
    }
    lowered = torch_schedules._add_send_recv(compute, ranks.__getitem__, len(ranks))
    torch_schedules._simulate_comms_compute(lowered, ranks.__getitem__, len(ranks))


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (3, 12)])
def test_every_order_passes_torchs_own_dry_run(
    name: str, pp: int, microbatches: int, capsys: pytest.CaptureFixture[str]
) -> None:
    order = action_order(name, pp, microbatches)
    ranks = stage_ranks(name, pp)
    assert {a.stage: r for r, acts in order.items() for a in acts} == ranks
    _torch_dry_run(order, ranks)
    check_order(order, microbatches)
    assert capsys.readouterr().out == ""  # torch prints its half-built schedule on a deadlock


def test_dualpipev_overlapped_actions_are_expanded_in_order() -> None:
    # torch's (1F1;0B0)OVERLAP_F_B on one rank: its forward, then its backward.
    assert written(action_order("DualPipeV", 1, 2)) == {0: "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1"}


def test_stage_placement() -> None:
    assert [stages_per_rank(n) for n in ("GPipe", "1F1B", "LoopedBFS", "DualPipeV")] == [1, 1, 2, 2]
    assert [stage_style(n) for n in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")] == [
        "loop",
        "loop",
        "v",
        "v",
    ]
    assert [rank_stages("InterleavedZeroBubble", 4, r) for r in range(4)] == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert [rank_stages("ZBVZeroBubble", 4, r) for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    assert rank_stages("1F1B", 4, 3) == [3]


def test_schedule_names_take_torchs_spellings() -> None:
    assert schedule_class("1f1b") is schedule_class("Schedule1F1B") is torch_schedules.Schedule1F1B
    assert schedule_class("ScheduleDualPipeV") is torch_schedules.ScheduleDualPipeV
    assert action_order("interleaved1f1b", 2, 4) == action_order("ScheduleInterleaved1F1B", 2, 4)


def test_orders_are_cached_but_never_shared() -> None:
    first = action_order("1F1B", 2, 4)
    first[0].clear()
    assert len(action_order("1F1B", 2, 4)[0]) == 8


def test_microbatch_rules_are_torchs() -> None:
    check_microbatches("1F1B", 4, 4)
    check_microbatches("Interleaved1F1B", 4, 10)  # 2 rounds of 5
    with pytest.raises(
        WorkbenchError, match=r"greater than or equal to the number of stages \(4\)"
    ):
        check_microbatches("1F1B", 4, 3)
    with pytest.raises(WorkbenchError, match=r"multiple of the number of rounds \(2\)"):
        check_microbatches("Interleaved1F1B", 4, 9)
    with pytest.raises(WorkbenchError, match="at least as many microbatches as stages"):
        check_microbatches("DualPipeV", 2, 3)


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ({0: actions("0F0 0B0"), 1: actions("0F1 0B1")}, "stage 0 runs on ranks 0 and 1"),
        ({0: actions("0F0 0B0 1F0 1B0 0F1 0B1")}, "stage 1 microbatch 1 runs nothing"),
        ({0: actions("0B0 0F0")}, "runs B, F; it must run F then B"),
        ({0: actions("0F0 0I0 0B0")}, "runs F, I, B"),
        ({0: actions("1F0 1B0")}, r"stages must be 0..0, got \[1\]"),
    ],
)
def test_check_order_refuses(order: dict[int, list[Action]], message: str) -> None:
    with pytest.raises(WorkbenchError, match=message):
        check_order(order)


# --- memory -------------------------------------------------------------------------------

F = PhaseCost(1.0, 10, 100)  # each forward saves 100 bytes, 10 more while it runs
B = PhaseCost(2.0, 20, 0)


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_first_rank_holds_pp_microbatches(pp: int) -> None:
    costs = {s: stage(s, resident=1000, grads=500, F=F, B=B) for s in range(pp)}
    result = simulate(action_order("1F1B", pp, 2 * pp), costs)
    first = result.ranks[0]
    assert (first.peak_action, first.inflight_microbatches) == ("0B0", pp)
    assert first.peak_bytes == 1000 + 500 + pp * 100 + 20
    # The last rank runs one microbatch at a time.
    assert result.ranks[-1].inflight_microbatches == 1
    assert [s.inflight_microbatches for s in result.stages] == list(range(pp, 0, -1))
    assert result.peak_bytes == first.peak_bytes == result.stages[0].peak_bytes


def test_gpipe_first_rank_holds_every_microbatch() -> None:
    costs = {s: stage(s, resident=1000, grads=500, F=F, B=B) for s in range(2)}
    result = simulate(action_order("GPipe", 2, 6), costs)
    assert [(r.peak_action, r.inflight_microbatches) for r in result.ranks] == [
        ("0B0", 6),
        ("1B0", 6),
    ]
    assert result.ranks[0].peak_bytes == 1000 + 500 + 6 * 100 + 20


def test_interleaved_load_is_uneven_across_ranks() -> None:
    # Stages 0, 1 save 100 bytes per microbatch, stages 2, 3 save 10; B peaks 1 byte.
    # Rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 | 2B1 starts at 4 x 100 + 10 live (2F1 in flight).
    # Rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 | 1B0 starts at 3 x 100 (stage 3 drained).
    costs = {
        s: stage(s, F=PhaseCost(1.0, 0, 100 if s < 2 else 10), B=PhaseCost(1.0, 1, 0))
        for s in range(4)
    }
    result = simulate(action_order("Interleaved1F1B", 2, 4), costs)
    assert [(r.peak_bytes, r.peak_action, r.inflight_microbatches) for r in result.ranks] == [
        (411, "2B1", 5),
        (301, "1B0", 3),
    ]
    assert [(s.stage, s.rank, s.inflight_microbatches) for s in result.stages] == [
        (0, 0, 4),
        (1, 1, 3),
        (2, 0, 1),
        (3, 1, 0),
    ]


def test_zero_bubble_keeps_what_w_needs_between_i_and_w() -> None:
    # ZBV, pp 2: rank 0 holds stages 0 and 3 and runs
    # 0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1.
    costs = {
        s: stage(
            s,
            F=PhaseCost(1.0, 0, 100 if s == 0 else 10),
            I=PhaseCost(1.0, 1, 60 if s == 0 else 4),
            W=PhaseCost(1.0, 0, 0),
        )
        for s in range(4)
    }
    result = simulate(action_order("ZBVZeroBubble", 2, 2), costs)
    rank0 = result.ranks[0]
    assert [live for *_, live in rank0.timeline] == [
        100,
        200,
        210,
        204,
        200,
        210,
        204,
        200,
        160,
        100,
        60,
        0,
    ]
    assert (rank0.peak_bytes, rank0.peak_action, rank0.inflight_microbatches) == (211, "3I0", 3)
    assert [s.inflight_microbatches for s in result.stages if s.rank == 0] == [2, 1]


@pytest.mark.parametrize(
    ("name", "pp", "microbatches"),
    [("1F1B", 4, 8), ("Interleaved1F1B", 2, 4), ("ZBVZeroBubble", 2, 4), ("DualPipeV", 2, 4)],
)
def test_one_walk_serves_every_cost(name: str, pp: int, microbatches: int) -> None:
    """A pipeline walks its order once (`ScheduleWalk`) and simulates it for every policy:
    each simulation of the kept walk is the simulation of the order itself, timelines
    included, whatever the costs."""
    order = action_order(name, pp, microbatches)
    walk = ScheduleWalk.of(order)
    n = 1 + max(a.stage for acts in order.values() for a in acts)
    for scale in (1, 3, 7):
        costs = {
            s: stage(
                s,
                resident=1000 * scale,
                grads=50 + s,
                send=scale,
                F=PhaseCost(1.0 + s / scale, 3 * scale, 100 + 10 * s),
                B=PhaseCost(2.0, 20 * scale, 0),
                I=PhaseCost(1.5, s * scale, 40 + s),
                W=PhaseCost(0.5 * scale, 7, 0),
            )
            for s in range(n)
        }
        kept, fresh = simulate(walk, costs, 100.0, 0.01), simulate(order, costs, 100.0, 0.01)
        assert kept.to_json() == fresh.to_json()
        assert [r.timeline for r in kept.ranks] == [r.timeline for r in fresh.ranks]
    assert sum(map(len, walk.labels.values())) == len(walk.steps) == sum(map(len, order.values()))


def test_a_walk_refuses_an_order_that_deadlocks() -> None:
    # 0B0 waits for 1B0, which runs after 1F0, which waits for 0F0, which runs after 0B0
    order = {0: actions("0B0 0F0"), 1: actions("1F0 1B0")}
    with pytest.raises(WorkbenchError, match="deadlocks: rank 0 at 0B0, rank 1 at 1F0"):
        ScheduleWalk.of(order)


def test_a_full_backward_on_a_split_stage_runs_i_then_w() -> None:
    # 0F0 leaves 100; 0B0 adds the 7 gradient bytes, runs I (peak +30, leaves 40), then W
    # (peak +100 over 47).
    costs = {
        0: stage(
            0, grads=7, F=PhaseCost(1.0, 5, 100), I=PhaseCost(2.0, 30, 40), W=PhaseCost(3.0, 100, 0)
        )
    }
    result = simulate(action_order("1F1B", 1, 1), costs)
    assert result.ranks[0].timeline == [("0F0", 0.0, 1.0, 100), ("0B0", 1.0, 6.0, 7)]
    assert (result.peak_bytes, result.ranks[0].peak_action) == (147, "0B0")


def test_gradient_buffers_appear_at_the_first_backward() -> None:
    costs = {0: stage(0, resident=50, grads=1000, F=PhaseCost(1.0, 0, 10), B=PhaseCost(1.0, 0, 0))}
    result = simulate(action_order("GPipe", 1, 3), costs)
    assert [live for *_, live in result.ranks[0].timeline] == [60, 70, 80, 1070, 1060, 1050]


def test_i_or_w_on_a_stage_costed_with_one_backward_is_refused() -> None:
    costs = {s: stage(s, F=F, B=B) for s in range(4)}
    with pytest.raises(WorkbenchError, match=r"runs 3I0 but stage 3 has only B, F phases"):
        simulate(action_order("ZBVZeroBubble", 2, 2), costs)


# --- time ---------------------------------------------------------------------------------


def test_two_stage_step_time_by_hand() -> None:
    # 1F1B, pp 2, 3 microbatches; F 1 s, B 2 s; each hop 0.5 s + 100 bytes at 100 B/s.
    #  rank 0: 0F0 0-1, 0F1 1-2,            0B0 7-9, 0F2 9-10, 0B1 10-12,          0B2 16-18
    #  rank 1: 1F0 2.5-3.5, 1B0 3.5-5.5, 1F1 5.5-6.5, 1B1 6.5-8.5, 1F2 11.5-12.5, 1B2 12.5-14.5
    costs = {s: stage(s, send=100, F=F, B=B) for s in range(2)}
    result = simulate(action_order("1F1B", 2, 3), costs, p2p_bytes_per_s=100.0, p2p_latency_s=0.5)
    assert [(a, start) for a, start, _, _ in result.ranks[0].timeline] == [
        ("0F0", 0.0),
        ("0F1", 1.0),
        ("0B0", 7.0),
        ("0F2", 9.0),
        ("0B1", 10.0),
        ("0B2", 16.0),
    ]
    assert [start for _, start, _, _ in result.ranks[1].timeline] == [
        2.5,
        3.5,
        5.5,
        6.5,
        11.5,
        12.5,
    ]
    assert result.step_seconds == 18.0
    assert [(r.busy_seconds, r.bubble_seconds, r.bubble_fraction) for r in result.ranks] == [
        (9.0, 9.0, 0.5),
        (9.0, 9.0, 0.5),
    ]


def test_no_hop_between_stages_on_one_rank() -> None:
    # ZBV on one rank: stages 0 and 1 share it, so the 100 s latency is never paid.
    costs = {s: stage(s, send=10**9, F=F, I=B, W=B) for s in range(2)}
    result = simulate(action_order("ZBVZeroBubble", 1, 2), costs, 1.0, 100.0)
    assert result.step_seconds == result.ranks[0].busy_seconds == 2 * 2 * (1 + 2 + 2)
    assert result.ranks[0].bubble_seconds == 0.0


def test_1f1b_bubble_is_pp_minus_one_over_microbatches_plus_pp_minus_one() -> None:
    pp, microbatches = 4, 12
    costs = {s: stage(s, F=F, B=B) for s in range(pp)}
    result = simulate(action_order("1F1B", pp, microbatches), costs)
    assert result.step_seconds == (microbatches + pp - 1) * 3.0
    assert result.ranks[0].bubble_fraction == pytest.approx((pp - 1) / (microbatches + pp - 1))


def test_a_deadlocking_order_is_named() -> None:
    order = {0: actions("0F0 0B0 0F1 0B1"), 1: actions("1F0 1F1 1B0 1B1")}
    costs = {s: stage(s, F=F, B=B) for s in range(2)}
    with pytest.raises(WorkbenchError, match="deadlocks: rank 0 at 0B0, rank 1 at 1F1"):
        simulate(order, costs)


def test_result_json_carries_every_stage_and_rank() -> None:
    costs = {s: stage(s, F=F, B=B) for s in range(4)}
    data = simulate(action_order("Interleaved1F1B", 2, 4), costs).to_json()
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    assert data["peak_bytes"] == max(s["peak_bytes"] for s in data["stages"])
    assert set(data["ranks"][0]) >= {"rank", "stages", "peak_action", "bubble_fraction", "timeline"}
    assert data["ranks"][0]["timeline"][0] == ["0F0", 0.0, 1.0, 100]
