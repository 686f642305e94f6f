"""CPU offload at the tag level: what may be offloaded (one refusal vocabulary, as values)
and the offload step of deciding, with its host budget.

Entry points: `OffloadOptions`, `offload_refusal(facts, last)` (the rules, on facts),
`examine_offload(value, view)` (the offload pass's and its replay's check of a value of a
rematerialized graph: one examination, one storage walk), `decide_offload(...)`. Each says
why not as a `tags.Refused` (`tags.Refusal` and its values).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from workbench.decide.facts import (
    MIN_OFFLOAD_BYTES,
    OpFacts,
    StorageView,
    StorageWalk,
    walk_storage,
)
from workbench.decide.presets import DIALECTS, WORKBENCH, Dialect, Preset, preset_record
from workbench.decide.tables import DecideTables, decide_tables, replayed_by
from workbench.decide.tags import Refusal, Refused, SelectorRow, Tag, Why


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


# --- CPU offload ------------------------------------------------------------------------

# Graph trainer's view ops (`cpu_offload._VIEW_OPS`, by overload packet): never offloaded.
TITAN_VIEW_OPS = frozenset(
    "t transpose view _unsafe_view reshape unsqueeze squeeze slice select expand permute "
    "as_strided alias split narrow unfold detach".split()
)


def offload_refusal(f: OpFacts, last: int | None, dialect: Dialect = WORKBENCH) -> Refused | None:
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
        return Refused(Refusal.NOT_ONE_TENSOR)
    if f.gather is not None:
        return Refused(Refusal.FSDP_CHAIN)
    if f.op.startswith("_c10d_functional."):
        return Refused(Refusal.COLLECTIVE)
    layer = rules.layer(f)
    if layer is None:
        return Refused(Refusal.OUTSIDE_LAYERS)
    if layer == last:
        return Refused(Refusal.LAST_LAYER, (layer,))
    if not rules.storage_checks:
        if f.op.split(".")[1:2] and f.op.split(".")[1] in TITAN_VIEW_OPS:
            return Refused(Refusal.VIEW_OP)
    else:
        if f.random:
            return Refused(Refusal.RANDOM)
        if f.mutation or storage.mutated:
            return Refused(Refusal.WRITTEN)
        if not storage.fresh:
            return Refused(Refusal.ALIAS)
        if storage.output:
            return Refused(Refusal.RETURNED)
    if not storage.contiguous:
        return Refused(Refusal.NOT_CONTIGUOUS)
    if storage.bytes < MIN_OFFLOAD_BYTES:
        return Refused(Refusal.TOO_SMALL, (storage.bytes, MIN_OFFLOAD_BYTES))
    return None


def kept_for_backward(
    tags: Mapping[str, Tag], by_name: Mapping[str, OpFacts]
) -> Callable[[OpFacts], bool]:
    """A test of whether torch's remat pass keeps a saved node's storage for backward: a
    backward node reads it (or a saved forward view of it), or a recomputed node that
    backward needs does. Users that are not forward nodes are backward ones. The storage
    walk (`walk_storage`) on the facts: a saved view of the node shares its storage."""
    replayed = replayed_by(tags, by_name)

    def shares(user: str, seen: set[Any]) -> bool:
        storage = by_name[user].storage
        return storage is not None and not storage.fresh and not tags[user].recompute

    view = StorageView(
        readers=lambda name: by_name[name].users,
        value=lambda name: name,
        is_output=lambda name: False,  # the output is not a forward node: a backward reader
        in_backward=lambda name: name not in by_name or replayed(name),
        shares=shares,
        writes=lambda name: False,
    )
    return lambda f: bool(walk_storage(f.name, view).readers)


class OffloadView(NamedTuple):
    """How `examine_offload` reads one form of a rematerialized graph: whether a value is a
    forward op call of it, returns one tensor, owns its storage (not a view or alias of an
    input's), its name, and the storage walk's view (`facts.StorageView`)."""

    forward_op: Callable[[Any], bool]
    one_tensor: Callable[[Any], bool]
    fresh: Callable[[Any], bool]
    name: Callable[[Any], str]
    storage: StorageView


def examine_offload(value: Any, view: OffloadView) -> Refused | StorageWalk:
    """Whether the offload pass can offload `value` of a rematerialized graph safely: why
    not, or its storage walk (aliases, backward readers, forward readers), which places the
    copies. It must be a forward op call returning one tensor that owns its storage, which
    the step does not return, no forward op writes in place (the first of the two the walk
    meets is said), and backward reads. The offload pass (FX nodes) and its replay on index
    arrays both ask this, so they refuse the same values in the same terms."""
    if not view.forward_op(value):
        return Refused(Refusal.NOT_FORWARD)
    if not view.one_tensor(value):
        return Refused(Refusal.NOT_ONE_TENSOR)
    if not view.fresh(value):
        return Refused(Refusal.ALIAS)
    walk = walk_storage(value, view.storage)
    if walk.writers and (walk.written_first or not walk.returned):
        return Refused(Refusal.WRITTEN_BY, (view.name(walk.writers[0]),))
    if walk.returned:
        return Refused(Refusal.RETURNED)
    if not walk.readers:
        return Refused(Refusal.NOT_READ)
    return walk


def offload_refusal_in(
    tables: DecideTables, tags: Mapping[str, Tag], name: str, preset: str
) -> Refused | None:
    """Why node `name` may not be offloaded under `tags` (the rules and the keep test of
    `decide_offload`, budget aside), or None if it may. Reads the facts through their
    `tables`: a flip or a look at one node costs that node's users, not the graph."""
    dialect = preset_record(preset).dialect
    by_name = tables.by_name
    refusal = offload_refusal(by_name[name], tables.last_layers[dialect], dialect)
    if refusal is None and not kept_for_backward(tags, by_name)(by_name[name]):
        return Refused(Refusal.NOT_READ)
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
    tables: DecideTables | None = None,
) -> None:
    """The offload step, in place on `tags`. An offload preset offloads every saved node
    the policy did not ask to save by name that may be offloaded and is kept for backward;
    an `offload` request (selector or override) the rules cannot grant is saved instead,
    tagged `Why.OFFLOAD_REFUSED` with the reason. Then the budget: offloads are kept largest
    first (graph order among equals) while they fit; the rest go back to their preset's
    save (`OFFLOAD_REFUSED` when asked for by name). The facts' `tables`, when given,
    saves the lookups built from them."""
    dialect, offloads = preset.dialect, preset.offloads is not None
    storage_checks = DIALECTS[dialect].storage_checks
    tables = tables or decide_tables(facts)
    last = tables.last_layers[dialect]
    kept = kept_for_backward(tags, tables.by_name)
    chosen: list[OpFacts] = []
    before: dict[str, Tag] = {}
    if not offloads:  # only offload requests can be chosen: a walk over those alone
        asking = (name for name, tag in tags.items() if tag.offload)
        facts = [tables.by_name[n] for n in sorted(asking, key=tables.writes.position.__getitem__)]
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
            refusal = None if unread else Refused(Refusal.NOT_READ)
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
            detail = Refused(Refusal.OVER_BUDGET, (budget, used))
            tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, detail)
