"""Published per-GPU memory of real training runs, as data: each run's source, its whole
configuration, the workbench preset standing for its checkpointing and what it does that the
workbench does not model. `python -m workbench validate` estimates each beside its figure.

Entry points: `PUBLISHED_RUNS` (id -> `PublishedRun`, in table order) and `select_runs(ids)`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from workbench.capture.degrees import Degrees
from workbench.decide.presets import preset_record
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.decide.policy import Policy

__all__ = ["PUBLISHED_RUNS", "PublishedRun", "select_runs"]

GIB = 2**30

# torchtitan logs `memory: X GiB (Y %)`: `torch.cuda.memory_stats()["reserved_bytes.all.peak"]`
# (what the caching allocator reserved; not the CUDA context or NCCL's buffers) over the
# device's `total_memory` (`torchtitan/components/metrics.py`, DeviceMemoryMonitor).
Quantity = Literal["max_memory_reserved"]
# Every launcher of these runs sets `PYTORCH_ALLOC_CONF=expandable_segments:True`
# (torchtitan's run_train.sh, and run_llama_train.sh since 2024-10-22, commit a5e57e4a9).
EXPANDABLE = True

MIXED_BF16 = (
    "bfloat16 mixed precision: fp32 parameters and AdamW state, bf16 compute "
    "(FSDP param_dtype), fp32 gradient reduce"
)
H100_96GB = "NVIDIA H100 SXM 96 GB HBM2e, 500 W (Meta's Grand Teton hosts)"
B200 = "NVIDIA B200"

PR_2377 = "https://github.com/pytorch/torchtitan/pull/2377"
PR_2570 = "https://github.com/pytorch/torchtitan/pull/2570"
PR_3429 = "https://github.com/pytorch/torchtitan/pull/3429"
BENCH_2412 = (
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
)

# what every run of a family shares that the workbench does not model
_GRAPH_TRAINER = (
    "graph trainer's compile-time passes after tagging (bucketing and reordering, regional "
    "inductor) are not applied; the workbench runs torch's remat pass on its own trace"
)
_BENCH_EAGER = (
    "an eager FSDP2 run (per-block checkpoint wrappers, FSDP2's hooks and prefetch), not one "
    "graph: its buffers and frees are its own"
)
_COMPILED = (
    "torch.compile per transformer block (inductor fuses elementwise ops and frees their "
    "intermediates): not modelled, the estimate is of the uncompiled graph"
)
_FLOAT8 = (
    "Float8 linears (torchao, float8 all-gather in FSDP): matmul inputs and gathered weights "
    "in float8 in parts of the step; the workbench traces bf16 throughout"
)
_TORCHTITAN_SPLIT = (
    "layers split as torchtitan's 2024-12 `generate_split_points` split them (the same "
    "layers per stage as the workbench's split here)"
)
_SDPA_8B = (
    "torchtitan's Llama3 8B at that date: separate wq, wk, wv (fused wqkv came 2026-04-16) "
    "and SDPA attention, traced as the kernel torch picks on the row's GPU (cuDNN on Hopper "
    "and Blackwell in torch 2.13; flash in torchtitan's own SDPA order saves the same output "
    "and log-sum-exp, 8 bytes of philox state apart)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedRun:
    """One published per-GPU figure and the run behind it."""

    id: str
    """Stable name: `validate --rows ID,...` picks rows by it."""
    title: str
    source: str
    """URL of the PR, benchmark file or log the figure is quoted from."""
    source_detail: str
    """Where in the source: the table, row and column, or the log line."""
    date: str
    """When the run was published (YYYY-MM-DD)."""
    published_model: str
    """The model as the source names it."""
    model: str
    """The workbench model spec standing for it (`--model`)."""
    gpus: int
    fsdp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    pp_schedule: str | None = None
    """torch's schedule name (`--pp-schedule`), with pp > 1."""
    microbatches: int | None = None
    """Microbatches per step, with pp > 1."""
    local_batch: int
    """Sequences per step on one data-parallel rank."""
    seq: int
    ac: str
    """The run's activation checkpointing as its source or config states it: a short name,
    then after a colon what it does."""
    policy: str
    """The workbench preset standing for it (`--policy`), with `selectors` and
    `fsdp_reshard` on top (`workbench_policy`)."""
    selectors: tuple[tuple[str, str], ...] = ()
    """(MODULE_PATTERN::OP, action) selectors the run's checkpointing adds to its preset."""
    fsdp_reshard: bool = True
    """False where the run kept FSDP's gathered parameters from forward to backward."""
    backward_inputs: Literal["freed", "held"] = "freed"
    """What the run's backward did with what forward saved (`Estimator`'s
    `backward_inputs`): `held` for an FX GraphModule backward called as f(*args)."""
    dtype: str = MIXED_BF16
    optimizer: Literal["adamw"] = "adamw"
    device: str
    device_memory_gib: float | None
    """The device's memory as torch reports it (`total_memory`), what the published
    percentage is of; None where no percentage was published."""
    device_note: str
    """How the device (and its memory) is known."""
    profile: str
    """The workbench device profile standing for it (`--profile`): rates and what lies
    outside the allocator."""
    expandable_segments: bool = EXPANDABLE
    published_gib: float
    published_pct: float | None = None
    quantity: Quantity = "max_memory_reserved"
    config_source: str
    """Where the fields the figure's source does not state (batch, seq, ...) come from."""
    differences: tuple[str, ...] = field(default=())
    """What the run does that the workbench does not model."""
    ran: Literal["graph", "eager"] = "graph"
    """How the published step ran: one traced graph (torchtitan's compiler toolkit, graph
    trainer), estimated by the preset on the workbench's graph; or eager PyTorch (its
    checkpoint wrappers, FSDP2's hooks), estimated by the eager baseline of the same AC run
    under torch's memory trackers (`workbench.interop.eager_runs`) where one exists."""

    @property
    def published_bytes(self) -> int:
        return round(self.published_gib * GIB)

    @property
    def degrees(self) -> Degrees:
        """The run's degrees (its fields, flat in its JSON)."""
        return Degrees(fsdp=self.fsdp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)

    @property
    def trace_key(self) -> tuple[Any, ...]:
        """Rows with the same key share one trace (they differ in policy only); the profile
        names the GPU whose kernels the graph carries."""
        pipeline = (self.pp_schedule, self.microbatches)
        return (self.model, self.profile, self.degrees, pipeline, self.local_batch, self.seq)

    @property
    def workbench_policy(self) -> Policy:
        """The policy the row is estimated with: its preset, selectors and FSDP choice."""
        from workbench.decide.policy import Policy, Selector

        selectors = [Selector(select, action) for select, action in self.selectors]  # type: ignore[arg-type]
        return Policy(self.policy, selectors=selectors, fsdp_reshard=self.fsdp_reshard)

    @property
    def policy_arg(self) -> str:
        """`--policy`'s value: the preset's name, or the policy as JSON where the row adds
        selectors or an FSDP choice to it."""
        if not self.selectors and self.fsdp_reshard:
            return self.policy
        return json.dumps(self.workbench_policy.to_json(), separators=(",", ":"))

    def estimate_argv(self, layers: int | None = None, seq: int | None = None) -> list[str]:
        """The `python -m workbench estimate` flags giving this row's estimate."""
        argv = ["--model", self.model, "--mode", "fake", "--policy", self.policy_arg]
        for name, degree in self.degrees.used(()).items():
            if name != "pp":  # with its schedule and microbatches
                argv += [f"--{name}", str(degree)]
        if self.pp > 1:
            argv += ["--pp", str(self.pp), "--pp-schedule", str(self.pp_schedule)]
            argv += ["--microbatches", str(self.microbatches)]
        argv += ["--batch", str(self.local_batch), "--seq", str(seq or self.seq)]
        if layers is not None:
            argv += ["--layers", str(layers)]
        argv += ["--profile", self.profile]
        if self.expandable_segments and self.pp == 1:
            argv.append("--expandable-segments")
        if self.backward_inputs != "freed":
            argv += ["--backward-inputs", self.backward_inputs]
        return argv

    def estimate_command(self, layers: int | None = None, seq: int | None = None) -> str:
        """The row's estimate as one shell command."""
        return shlex.join(
            ["python", "-m", "workbench", "estimate", *self.estimate_argv(layers, seq)]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "selectors": [
                {"select": select, "action": action} for select, action in self.selectors
            ],
            "differences": list(self.differences),
        }


# How PR #2377 and PR #2570 ran all three of their rows: torchtitan's compiler toolkit, which
# became graph trainer's `aot` mode (its default) on 2026-03-10 (#2457)
_TOOLKIT_RUN = (
    "the compiler toolkit (graph trainer's aot mode from 2026-03-10): dynamo traced the "
    "model's step (eager SAC: torchtitan's checkpoint wrappers inside it, the HOP the PRs "
    "report failing on DeepSeek-V3, torchtitan#1935), aot_export_joint_with_descriptors and "
    "the default partitioner split it (every op tagged for recompute is recomputed, every "
    "other one backward reads is saved), the loss ran eagerly; the workbench's graph of the "
    "same step is estimated with the same tags"
)


# An FX GraphModule backward holds its inputs (`Estimator`'s backward_inputs="held")
def _toolkit_backward(gradient_gib: float) -> str:
    """How the toolkit's backward held its inputs, with the job's gradient shards."""
    return (
        "backward held what forward saved and the logits' gradient (0.98 GiB) until it "
        "returned: the toolkit's bw_compiler returned the partitioned GraphModule, which "
        "AOTAutograd calls as f(*args) (call_func_at_runtime_with_args), its list of arguments "
        f"alive to the end, by when the gradient shards ({gradient_gib:.2f} GiB) are resident; "
        "modelled (--backward-inputs held)"
    )


# Global matmul count of the toolkit's `apply_sac` on Llama3-8B's seven matmuls per layer
# (wq, wk, wv, wo, w1, w3, w2): even layers save the 1st, 3rd, 5th and 7th, odd layers the
# 2nd, 4th and 6th; the `eager` preset's count restarts each layer, as the even layers'.
_APPLY_SAC_ODD_LAYERS: tuple[tuple[str, str], ...] = tuple(
    (f"layers.*[13579].{module}::aten.mm.default", action)
    for module, action in (
        ("attention.wq", "recompute"),
        ("attention.wk", "save"),
        ("attention.wv", "recompute"),
        ("attention.wo", "save"),
        ("feed_forward.w1", "recompute"),
        ("feed_forward.w3", "save"),
        ("feed_forward.w2", "recompute"),
    )
)


class _ToolkitJob(NamedTuple):
    """What a PR's Llama3-8B job of the compiler toolkit's rows states of itself."""

    slug: str  # the rows' id before their AC mode
    degrees: str  # as the titles write them
    source: str
    heading: str  # the PR description's heading of the job
    date: str
    trainer: str  # torchtitan's code that ran it
    gpus: int
    fsdp: int
    tp: int
    device: str
    device_memory_gib: float
    device_note: str
    profile: str
    config_source: str
    gradient_gib: float  # its gradient shards, resident as backward returns


_PR_2377_JOB = _ToolkitJob(
    slug="pr2377-8b-tp2-fsdp2",
    degrees="TP 2 x FSDP 2",
    source=PR_2377,
    heading="'Llama3-8B (TP=2, FSDP=2)'",
    date="2026-02-13",
    trainer="compiler toolkit",
    gpus=4,
    fsdp=2,
    tp=2,
    device=B200,
    device_memory_gib=round(67.19 / 0.3767, 2),
    device_note="the log's 67.19 GiB is 37.67 % of the device: 178.37 GiB, a B200 "
    "(torch reports 178.35 GiB, pytorch/ao#4002); its tflops / mfu (554.17 / 24.63 %) "
    "imply torchtitan's B200 peak, 2,250 TFLOP/s",
    profile="b200",
    config_source="torchtitan's llama3_8b config of that date (local batch 1, seq 8192: "
    "models/llama3/train_configs/llama3_8b.toml at 27930cb6); the PR's TP and FSDP degrees",
    gradient_gib=6.99,
)
_PR_2570_JOB = _ToolkitJob(
    slug="pr2570-8b-fsdp4-tp2",
    degrees="FSDP 4 x TP 2",
    source=PR_2570,
    heading="'Llama3-8B FSDP=4, TP=2'",
    date="2026-03-13",
    trainer="graph trainer, aot mode",
    gpus=8,
    fsdp=4,
    tp=2,
    device=H100_96GB,
    device_memory_gib=round(49.65 / 0.5227, 2),
    device_note="the log's 49.65 GiB is 52.27 % of the device: 94.99 GiB, more than an "
    "80 GB H100 holds; its tflops / mfu (282.50 / 28.56 %) imply torchtitan's H100 SXM "
    "peak, 989 TFLOP/s: the 96 GB H100 of torchtitan's benchmarks (benchmarks/"
    "llama3_h100_202412_torchtitan.md, 'Hardware')",
    profile="h100",
    config_source="torchtitan's graph_trainer_llama3_8b config of that date (llama3_8b: "
    "local batch 1, seq 8192, models/llama3/config_registry.py at fca8ab7b; compile mode "
    "'aot', its default); the PR's FSDP and TP degrees",
    gradient_gib=3.49,
)


def _llama3_8b_toolkit(
    job: _ToolkitJob,
    name: str,
    ac: str,
    gib: float,
    pct: float,
    *,
    policy: str,
    selectors: tuple[tuple[str, str], ...] = (),
    fsdp_reshard: bool = True,
    more: tuple[str, ...] = (),
) -> PublishedRun:
    """A row of a PR's Llama3-8B job run by the compiler toolkit (PR #2377) or graph
    trainer's aot mode (PR #2570): the toolkit's step, one of its three AC modes."""
    mode = ac.split(":")[0]
    return PublishedRun(
        id=f"{job.slug}-{name}",
        title=f"Llama3-8B {job.degrees}, {mode}",
        source=job.source,
        source_detail=f"PR description, {job.heading}: {mode} 'memory: {gib:.2f}GiB({pct:.2f}%)'",
        date=job.date,
        published_model=f"torchtitan Llama3 8B ({job.trainer})",
        model="llama3-8b",
        gpus=job.gpus,
        fsdp=job.fsdp,
        tp=job.tp,
        local_batch=1,
        seq=8192,
        ac=ac,
        policy=policy,
        selectors=selectors,
        fsdp_reshard=fsdp_reshard,
        backward_inputs="held",
        device=job.device,
        device_memory_gib=job.device_memory_gib,
        device_note=job.device_note,
        profile=job.profile,
        published_gib=gib,
        published_pct=pct,
        config_source=job.config_source,
        differences=(_SDPA_8B, _TOOLKIT_RUN, _toolkit_backward(job.gradient_gib), *more),
    )


def _dsv3_pr3429(
    policy: str,
    gib: float,
    more: tuple[str, ...] = (),
    selectors: tuple[tuple[str, str], ...] = (),
) -> PublishedRun:
    name = preset_record(policy).memory_policy
    return PublishedRun(
        id=f"pr3429-dsv3-16b-{name}",
        title=f"DeepSeek-V3 16B FSDP 8 x EP 8, graph trainer memory policy {name}",
        source=PR_3429,
        source_detail=f"PR description, DeepSeek-V3 16B benchmark: `{name}` peak memory "
        f"{gib:.2f} GiB",
        date="2026-05-26",
        published_model="torchtitan DeepSeek-V3 16B (graph_trainer_deepseek_v3_16b)",
        model="torchtitan:deepseek_v3/16B",
        gpus=8,
        fsdp=8,
        ep=8,
        local_batch=4,
        seq=4096,
        ac=f"graph SAC {name}: graph trainer's --compile.memory_policy {name}",
        policy=policy,
        selectors=selectors,
        device=H100_96GB,
        device_memory_gib=None,
        device_note="the PR runs on 8 H100s; 84.78 GiB exceeds what an 80 GB H100 holds "
        "(79.1 GiB as torch reports it), and the PR's Llama3 rows (30.92 GiB at 33 %, "
        "52.44 GiB at 55 %) imply a 94-95 GiB device: the 96 GB H100",
        profile="h100",
        published_gib=gib,
        config_source="torchtitan's deepseek_v3_16b config (local batch 4, seq 4096, EP 8, "
        "FSDP over the 8 GPUs: models/deepseek_v3/config_registry.py at f39e1245), which "
        "graph_trainer_deepseek_v3_16b runs",
        differences=(
            "attention: the 16B config runs flex attention (deepseek_v3_16b, "
            "attn_backend='flex'), traced as its op for the GPU (a CPU trace would run SDPA's "
            "math path and save seq x seq scores per layer: MLA's query/key head dim 192 is not "
            "its value head dim 128); the block mask is causal, one document per sequence",
            "loss: graph trainer swaps the config's ChunkedCELoss for CrossEntropyLoss "
            "(graph_trainer/deepseek_v3/config_registry.py)",
            "experts receive a balanced token count (fake tensors cannot route)",
            _GRAPH_TRAINER,
            *more,
        ),
    )


def _bench_2412(**row: Any) -> PublishedRun:
    """A row of torchtitan's December 2024 H100 benchmarks (commit 9dec370 of 2024-12-26):
    eager FSDP2 runs."""
    return PublishedRun(
        ran="eager",
        source=BENCH_2412,
        date="2024-12-26",
        device=H100_96GB,
        device_memory_gib=None,
        device_note="the file's 'Hardware': Grand Teton hosts, 8 H100 each with 96 GB HBM2e "
        "at 2.4 TB/s, 500 W; no percentage published",
        profile="h100",
        seq=8192,
        config_source="the file's table caption (GPUs, degrees, local batch, AC) and "
        "train_configs/llama3_{8b,70b,405b}.toml at its torchtitan commit 9dec370 (seq 8192)",
        **row,
    )


_SELECTIVE_OP = (
    "eager SAC: activation_checkpoint mode 'selective', selective_ac_option 'op' "
    "(train_configs/llama3_8b.toml): every second matmul of a block recomputed"
)
_FULL_AC = "full AC: activation_checkpoint mode 'full', every block recomputed in backward"
# What the compiler toolkit of 2026-02 (27930cb6) did to PR #2377's no-AC step, measured on the
# workbench's graph of the row (GiB allocated / reserved): the graph with unshard chains
# recomputed 52.48 / 53.28, gathered weights kept 61.43 / 61.74, and also held to the end of
# backward with the rest of what forward saved and the logits' gradient 63.04 / 63.22.
_TOOLKIT_NO_AC_KEEPS_GATHERED = (
    "reshard after forward not in effect: fsdp_reshard_after_fwd_pass tags all_gather, "
    "wait_tensor and slice MUST_RECOMPUTE, not the untagged views (t, view) between the wait "
    "and the matmuls, which the default partitioner saves: the gathered bf16 weights "
    "(6.99 GiB) stay from forward to backward; modelled (fsdp_reshard false)"
)
# Measured by `python -m workbench bench toolkit --model torchtitan:llama3/8B --seq 8192
# --mode fake --fsdp 2 --tp 2 --kernels b200` (one rank on fake tensors, torch's MemTracker)
_TOOLKIT_PARTITION = (
    "the default partitioner reads SAC tags otherwise than torch's remat pass, which the "
    "estimate replays: it never saves a multi-output op (attention, RMSNorm) and saves a "
    "getitem left untagged (under apply_sac until PR #2570 gave getitems their parent's tag) "
    "only where backward reads it directly, recomputing the rest; the toolkit's step of one "
    "rank of graph trainer's Llama3-8B at TP 2 x FSDP 2, seq 8192 (bench toolkit --mode fake: "
    "its SimpleFSDP, DTensor gradients, default partitioner, held backward and eager loss on "
    "fake tensors under torch's MemTracker) peaks 66,560 bytes above the estimate of the same "
    "tags so read, for no AC, for apply_sac, for graph trainer's apply_sac_pass of PR #2570 "
    "and for torchtitan's eager SAC wrappers (dynamo captures each as a checkpoint HOP, whose "
    "tags give getitems their op's tag)"
)
# The same run, held backward: apply_sac_pass 26,198,951,944 bytes and torchtitan's
# SelectiveAC wrappers 27,596,810,248, each 66,560 above the estimate of
# `toolkit.apply_sac_pass_decisions` / `toolkit.eager_sac_decisions` on the same graph.
_TOOLKIT_EAGER_OUTSIDE = (
    "outside the wrapped blocks nothing is tagged: the default partitioner saves the views of "
    "the output projection's gathered weight (0.49 GiB), which stays from forward to backward "
    "(the eager preset reshards it); modelled (selector output::** save: the reading of "
    "workbench.interop.toolkit.eager_sac_decisions within 8 KB)"
)
_APPLY_SAC_COUNT = (
    "apply_sac counts matmuls over the whole step: the preset's per-layer count with its odd "
    "layers flipped (selectors) is that count on these layers"
)


def _traced_eager_sac(allocated: float, reserved: float) -> str:
    """What tracing changes of eager SAC, with the eager trainer's figures for the job."""
    return (
        "traced, the wrappers' op rule tags the graph and the partitioner saves what backward "
        "reads of what it tags saved; the eager trainer caches every such op's output (run "
        f"eagerly under torch's trackers: {allocated:.2f} GiB allocated, {reserved:.2f} reserved)"
    )


_EAGER_SAC_LIST = (
    "torchtitan's eager SAC save list also holds reduce-scatter outputs and aten.max / abs "
    "(parallelize_llama.py `_save_list`)"
)


def _toolkit_eager_sac(
    job: _ToolkitJob, gib: float, pct: float, eager_trainer: tuple[float, float]
) -> PublishedRun:
    """A toolkit job's eager SAC row: torchtitan's wrappers traced, the output projection's
    gathered weight kept (`output::** save`, as nothing outside the wrappers is tagged);
    `eager_trainer`, the eager trainer's allocated and reserved GiB for the same job."""
    return _llama3_8b_toolkit(
        job,
        "eager",
        "eager SAC: torchtitan's checkpoint wrappers with its op rule (every second matmul "
        "of a block recomputed)",
        gib,
        pct,
        policy="eager",
        selectors=(("output::**", "save"),),
        more=(
            _EAGER_SAC_LIST,
            _TOOLKIT_EAGER_OUTSIDE,
            _traced_eager_sac(*eager_trainer),
            _TOOLKIT_PARTITION,
        ),
    )


_RUNS: tuple[PublishedRun, ...] = (
    _dsv3_pr3429("titan-default", 84.78),
    _dsv3_pr3429(
        "titan-full",
        52.02,
        (
            "higher-order ops saved: the PR's branch when its description was written "
            "(cf4423bc, 2026-05-26) tagged every higher-order op MUST_SAVE (flex_attention; "
            "inductor_compiled_code, which the workbench's graph has none of); 7faef1e7 "
            "(2026-06-02, merged with the PR) recomputes flex_attention, as titan-full does. "
            "Modelled (a selector saving flex_attention: 27 layers x 65 MiB, 1.71 GiB); "
            "titan-full alone gives 42.92 GiB allocated, 46.16 reserved (−11.3 %)",
        ),
        selectors=(("**::flex_attention", "save"),),
    ),
    _llama3_8b_toolkit(
        _PR_2377_JOB,
        "none",
        "no AC",
        67.19,
        37.67,
        policy="none",
        fsdp_reshard=False,
        more=(_TOOLKIT_NO_AC_KEEPS_GATHERED,),
    ),
    _toolkit_eager_sac(_PR_2377_JOB, 45.88, 25.73, eager_trainer=(41.68, 51.50)),
    _llama3_8b_toolkit(
        _PR_2377_JOB,
        "default",
        "graph SAC: --compile.joint_passes apply_sac (the compiler toolkit's save list, every "
        "second matmul of the step recomputed)",
        44.20,
        24.78,
        policy="eager",
        selectors=_APPLY_SAC_ODD_LAYERS,
        more=(
            _APPLY_SAC_COUNT,
            _TOOLKIT_PARTITION,
            "apply_sac tags every forward op up to the logits (one ac_graph_id, so no layer "
            "boundary is saved) and leaves the loss untagged; the preset saves each layer's "
            "boundary and everything outside the layers",
            "apply_sac's own tags on this row's graph as the default partitioner reads them "
            "(workbench.interop.toolkit.apply_sac_decisions, the same held backward and "
            "allocator): 39.24 GiB allocated, 39.65 reserved (−10.3 %)",
        ),
    ),
    _llama3_8b_toolkit(
        _PR_2570_JOB,
        "none",
        "no AC",
        49.65,
        52.27,
        policy="none",
        fsdp_reshard=False,
        more=(_TOOLKIT_NO_AC_KEEPS_GATHERED,),
    ),
    _toolkit_eager_sac(_PR_2570_JOB, 28.54, 30.04, eager_trainer=(30.46, 36.39)),
    _llama3_8b_toolkit(
        _PR_2570_JOB,
        "default",
        "graph SAC: graph trainer's apply_sac with its default policy (compute-intensive ops "
        "from torch's partitioner list saved, every second matmul of the step recomputed)",
        28.09,
        29.57,
        policy="eager",
        selectors=_APPLY_SAC_ODD_LAYERS,
        more=(
            _APPLY_SAC_COUNT,
            _TOOLKIT_PARTITION,
            "apply_sac_pass tags every op of the joint graph, backward's too (one ac_graph_id, "
            "so no layer boundary is saved; the loss ran eagerly, untagged); the preset saves "
            "each layer's boundary and everything outside the layers",
            "apply_sac_pass's own tags on this row's graph (workbench.interop.toolkit."
            "apply_sac_pass_decisions: getitems and waits tagged as their op, which the default "
            "partitioner reads as they are; the same held backward and allocator): 24.52 GiB "
            "allocated, 24.98 reserved (−11.1 %)",
        ),
    ),
    _bench_2412(
        id="bench2412-8b-fsdp8-sac",
        title="Llama3.1-8B FSDP 8, selective AC",
        source_detail="Table 1 (8 GPUs, local batch 2, selective AC), row 'FSDP', Memory(GiB)",
        published_model="Llama 3.1 8B (torchtitan llama3 8B)",
        model="llama3-8b",
        gpus=8,
        fsdp=8,
        local_batch=2,
        ac=_SELECTIVE_OP,
        policy="eager",
        published_gib=82.4,
        differences=(_BENCH_EAGER, _EAGER_SAC_LIST),
    ),
    _bench_2412(
        id="bench2412-8b-fsdp8-sac-compile",
        title="Llama3.1-8B FSDP 8, selective AC, torch.compile",
        source_detail="Table 1 (8 GPUs, local batch 2, selective AC), row 'FSDP + "
        "torch.compile', Memory(GiB)",
        published_model="Llama 3.1 8B (torchtitan llama3 8B)",
        model="llama3-8b",
        gpus=8,
        fsdp=8,
        local_batch=2,
        ac=_SELECTIVE_OP,
        policy="eager",
        published_gib=77.0,
        differences=(_COMPILED, _BENCH_EAGER, _EAGER_SAC_LIST),
    ),
    _bench_2412(
        id="bench2412-8b-fsdp128-sac",
        title="Llama3.1-8B FSDP 128, selective AC",
        source_detail="Table 3 (128 GPUs, local batch 2, selective AC), row 'FSDP', Memory(GiB)",
        published_model="Llama 3.1 8B (torchtitan llama3 8B)",
        model="llama3-8b",
        gpus=128,
        fsdp=128,
        local_batch=2,
        ac=_SELECTIVE_OP,
        policy="eager",
        published_gib=67.0,
        differences=(_BENCH_EAGER, _EAGER_SAC_LIST),
    ),
    _bench_2412(
        id="bench2412-70b-fsdp32-tp8-full",
        title="Llama3.1-70B FSDP 32 x TP 8, full AC",
        source_detail="Table 4 (256 GPUs, FSDP 32, TP 8, local batch 16, full AC, "
        "torch.compile, Float8), row '2D', Memory(GiB)",
        published_model="Llama 3.1 70B (torchtitan llama3 70B)",
        model="llama3-70b",
        gpus=256,
        fsdp=32,
        tp=8,
        local_batch=16,
        ac=_FULL_AC,
        policy="full",
        published_gib=71.9,
        differences=(_COMPILED, _FLOAT8, _BENCH_EAGER),
    ),
    _bench_2412(
        id="bench2412-405b-pp8-1f1b",
        title="Llama3.1-405B FSDP 8 x TP 8 x PP 8, 1F1B, full AC",
        source_detail="Table 5 (512 GPUs, FSDP 8, TP 8, PP 8, local batch 32, full AC, "
        "torch.compile, Float8, AsyncTP), row '1F1B', Memory(GiB): the maximum over all GPUs",
        published_model="Llama 3.1 405B (torchtitan llama3 405B)",
        model="llama3-405b",
        gpus=512,
        fsdp=8,
        tp=8,
        pp=8,
        pp_schedule="1F1B",
        microbatches=8,
        local_batch=32,
        ac=_FULL_AC,
        policy="full",
        published_gib=82.5,
        differences=(
            "microbatches: torchtitan's default at that date, the pipeline degree (8), so "
            "4 sequences each",
            _TORCHTITAN_SPLIT,
            _COMPILED,
            _FLOAT8,
            "async TP (symmetric-memory buffers for the TP collectives): not modelled",
            _BENCH_EAGER,
        ),
    ),
    _bench_2412(
        id="bench2412-405b-pp8-interleaved",
        title="Llama3.1-405B FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, full AC",
        source_detail="Table 5 (512 GPUs, FSDP 8, TP 8, PP 8, local batch 32, full AC, "
        "torch.compile, Float8, AsyncTP), row 'Interleaved 1F1B', Memory(GiB): the maximum "
        "over all GPUs",
        published_model="Llama 3.1 405B (torchtitan llama3 405B)",
        model="llama3-405b",
        gpus=512,
        fsdp=8,
        tp=8,
        pp=8,
        pp_schedule="Interleaved1F1B",
        microbatches=8,
        local_batch=32,
        ac=_FULL_AC,
        policy="full",
        published_gib=72.7,
        differences=(
            "microbatches: torchtitan's default at that date, the pipeline degree (8); two "
            "stages per rank (16 stages), its default for looped schedules",
            _TORCHTITAN_SPLIT,
            _COMPILED,
            _FLOAT8,
            "async TP (symmetric-memory buffers for the TP collectives): not modelled",
            _BENCH_EAGER,
        ),
    ),
)

PUBLISHED_RUNS: dict[str, PublishedRun] = {run.id: run for run in _RUNS}


def select_runs(ids: str | None) -> list[PublishedRun]:
    """The rows a comma-separated list of ids names, in table order (all for None); an
    unknown id is refused naming the valid ones."""
    if ids is None:
        return list(PUBLISHED_RUNS.values())
    wanted = [part.strip() for part in ids.split(",") if part.strip()]
    unknown = [i for i in wanted if i not in PUBLISHED_RUNS]
    if unknown or not wanted:
        raise WorkbenchError(
            f"--rows {ids!r}: unknown row {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(PUBLISHED_RUNS)}"
        )
    return [run for run in PUBLISHED_RUNS.values() if run.id in wanted]
