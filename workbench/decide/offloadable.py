"""CPU offload at the tag level: what may be offloaded (one refusal vocabulary) and the
offload step of deciding, with its host budget.

Entry points: `OffloadOptions`, `Refusal` (every reason a node is not offloaded, which the
offload pass and its replay on indices say too), `offload_refusal(facts, last)`,
`decide_offload(...)`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from workbench.decide.facts import MIN_OFFLOAD_BYTES, OpFacts
from workbench.decide.plan import DecidePlan, decide_plan, replayed_by
from workbench.decide.presets import DIALECTS, WORKBENCH, Dialect, Preset, preset_record
from workbench.decide.tags import SelectorRow, Tag, Why


class OffloadOptions(NamedTuple):
    """How offloaded activations move (graph trainer's `cpu_offload_*` options).

    `budget_bytes`: host bytes the offloaded storages may take, chosen largest first (None:
    no limit). `prefetch_layers`: the reload starts this many layers before the producer's
    layer in backward, never after the first backward reader (0: right before it), as graph
    trainer counts. `defer_layers`: the device copy is freed at the end of the layer this
    many layers after the producer's in forward (0: right after its last forward reader,
    which torchtitan 0.3.0's pass cannot do)."""

    budget_bytes: int | None = None
    prefetch_layers: int = 1
    defer_layers: int = 0


class Refusal(enum.Enum):
    """Why a node's output is not offloaded, as the end of a sentence that starts with the
    node's name; `{}` marks are filled by `say`. One vocabulary for the three checks: the
    rules here (on facts, before remat), `workbench.rewrite.offload.offload_pass` (on the
    rematerialized graph) and its replay on indices (`workbench.cost.replay.offload_schedule`),
    so a node refused twice is refused in the same words."""

    NOT_FORWARD = "is not a forward node of this graph"
    NOT_ONE_TENSOR = "returns no single tensor"
    FSDP_CHAIN = "is part of a parameter's FSDP all-gather chain"
    COLLECTIVE = "is a collective or its wait"
    OUTSIDE_LAYERS = "is outside the layers"
    LAST_LAYER = "is in the last layer ({}): backward reads it at once"
    VIEW_OP = "is a view op"
    RANDOM = "is a random op"
    WRITTEN = "has its storage written in place in forward"
    WRITTEN_BY = "has its storage written in place in forward by {}"  # the pass knows who
    ALIAS = "is a view or alias of another node's storage: offloading it frees nothing"
    RETURNED = "is returned by the step"
    NOT_CONTIGUOUS = "is not contiguous"
    TOO_SMALL = "is {} bytes, under the {}-byte minimum"
    NOT_READ = "is not read in backward after remat: nothing to offload"
    OVER_BUDGET = "over the offload budget of {} bytes ({} already offloaded)"

    def say(self, *values: object) -> str:
        """The sentence, its `{}` marks filled with `values` in order.

        >>> Refusal.LAST_LAYER.say(5)
        'is in the last layer (5): backward reads it at once'
        """
        return self.value.format(*values)


# --- CPU offload ------------------------------------------------------------------------

# Graph trainer's view ops (`cpu_offload._VIEW_OPS`, by overload packet): never offloaded.
TITAN_VIEW_OPS = frozenset(
    "t transpose view _unsafe_view reshape unsqueeze squeeze slice select expand permute "
    "as_strided alias split narrow unfold detach".split()
)


def offload_refusal(f: OpFacts, last: int | None, dialect: Dialect = WORKBENCH) -> str | None:
    """Why `f`'s output may not be offloaded, or None if it may: it must be one contiguous
    tensor of at least `MIN_OFFLOAD_BYTES` owning its storage (offloading a view frees
    nothing), made in a layer other than the last (`last`, as the dialect reads layers), by
    no random, in-place or communication op, with nothing writing into it later, not
    returned by the step. Graph trainer's dialect checks what graph trainer checks: its view
    list instead of storages, no random, in-place or output rule (the pass still skips what
    it cannot offload safely)."""
    rules = DIALECTS[dialect]
    storage = f.storage
    if storage is None:
        return Refusal.NOT_ONE_TENSOR.say()
    if f.gather is not None:
        return Refusal.FSDP_CHAIN.say()
    if f.op.startswith("_c10d_functional."):
        return Refusal.COLLECTIVE.say()
    layer = rules.layer(f)
    if layer is None:
        return Refusal.OUTSIDE_LAYERS.say()
    if layer == last:
        return Refusal.LAST_LAYER.say(layer)
    if not rules.storage_checks:
        if f.op.split(".")[1:2] and f.op.split(".")[1] in TITAN_VIEW_OPS:
            return Refusal.VIEW_OP.say()
    else:
        if f.random:
            return Refusal.RANDOM.say()
        if f.mutation or storage.mutated:
            return Refusal.WRITTEN.say()
        if not storage.fresh:
            return Refusal.ALIAS.say()
        if storage.output:
            return Refusal.RETURNED.say()
    if not storage.contiguous:
        return Refusal.NOT_CONTIGUOUS.say()
    if storage.bytes < MIN_OFFLOAD_BYTES:
        return Refusal.TOO_SMALL.say(storage.bytes, MIN_OFFLOAD_BYTES)
    return None


def kept_for_backward(
    tags: Mapping[str, Tag], by_name: Mapping[str, OpFacts]
) -> Callable[[OpFacts], bool]:
    """A test of whether torch's remat pass keeps a saved node's storage for backward: a
    backward node reads it (or a saved forward view of it), or a recomputed node that
    backward needs does. Users that are not forward nodes are backward ones."""
    replayed = replayed_by(tags, by_name)

    def kept(f: OpFacts) -> bool:
        todo, seen = [f], {f.name}
        while todo:
            for user in todo.pop().users:
                u = by_name.get(user)
                if u is None or replayed(user):
                    return True
                view = u.storage is not None and not u.storage.fresh
                if view and not tags[user].recompute and user not in seen:
                    seen.add(user)
                    todo.append(u)
        return False

    return kept


def offload_refusal_in(
    plan: DecidePlan, tags: Mapping[str, Tag], name: str, preset: str
) -> str | None:
    """Why node `name` may not be offloaded under `tags` (the rules and the keep test of
    `decide_offload`, budget aside), or None if it may. Reads the facts through their
    `plan`: a flip or a look at one node costs that node's users, not the graph."""
    dialect = preset_record(preset).dialect
    by_name = plan.by_name
    refusal = offload_refusal(by_name[name], plan.last_layers[dialect], dialect)
    if refusal is None and not kept_for_backward(tags, by_name)(by_name[name]):
        return Refusal.NOT_READ.say()
    return refusal


def may_offload(
    preset: str, selectors: Sequence[SelectorRow], overrides: Mapping[str, str] | None
) -> bool:
    """Whether a policy asks for any offload (its preset, a selector or an override): the
    offload step has nothing to do otherwise, the common case on every re-decision."""
    return (
        preset_record(preset).offloads is not None
        or any(row[2] == "offload" for row in selectors)
        or "offload" in (overrides or {}).values()
    )


def decide_offload(
    facts: Sequence[OpFacts],
    tags: dict[str, Tag],
    preset: Preset,
    options: OffloadOptions,
    plan: DecidePlan | None = None,
) -> None:
    """The offload step, in place on `tags`. An offload preset offloads every saved node
    the policy did not ask to save by name that may be offloaded and is kept for backward;
    an `offload` request (selector or override) the rules cannot grant is saved instead,
    tagged `Why.OFFLOAD_REFUSED` with the reason. Then the budget: offloads are kept largest
    first (graph order among equals) while they fit; the rest go back to their preset's
    save (`OFFLOAD_REFUSED` when asked for by name). The facts' `plan`, when given,
    saves the lookups built from them."""
    dialect, offloads = preset.dialect, preset.offloads is not None
    storage_checks = DIALECTS[dialect].storage_checks
    plan = plan or decide_plan(facts)
    last = plan.last_layers[dialect]
    kept = kept_for_backward(tags, plan.by_name)
    chosen: list[OpFacts] = []
    before: dict[str, Tag] = {}
    for f in facts:
        tag = tags[f.name]
        if tag.recompute:
            continue
        asked = tag.offload
        if not asked and (not offloads or tag.why in (Why.SELECTOR, Why.OVERRIDE)):
            continue
        refusal = offload_refusal(f, last, dialect)
        if refusal is None and not kept(f):
            # graph trainer offloads its MUST_SAVE tags, read in backward or not
            unread = not storage_checks and tag.policy is CheckpointPolicy.MUST_SAVE
            refusal = None if unread else Refusal.NOT_READ.say()
        if refusal is not None:
            if asked:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, refusal)
            continue
        before[f.name] = tag
        if not asked:  # MUST_: the one offload tag graph trainer's offload pass reads
            tags[f.name] = Tag(CheckpointPolicy.MUST_CPU_OFFLOAD, Why.PRESET, preset.name)
        chosen.append(f)
    budget, used = options.budget_bytes, 0
    if budget is None:
        return
    for f in sorted(chosen, key=lambda f: -f.storage.bytes):  # type: ignore[union-attr]
        size = f.storage.bytes  # type: ignore[union-attr]
        if used + size <= budget:
            used += size
        elif tags[f.name].why is Why.PRESET:
            tags[f.name] = before[f.name]
        else:
            detail = Refusal.OVER_BUDGET.say(budget, used)
            tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, detail)
