"""Deciding: every forward node's tag, step by step (`STEPS`), for graph SAC and eager SAC.

Entry points: `decide_ops(facts, preset, ...)` (the workbench's presets; `decide_titan_ops`
for graph trainer's) and `eager_tag(facts, ...)` (eager SAC's `policy_fn`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Mapping, Sequence

from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.ops import module_matches
from workbench.decide.facts import OpFacts
from workbench.decide.offloadable import OffloadOptions, decide_offload, may_offload
from workbench.decide.plan import REQUEST_MEMO, DecidePlan, decide_plan, replayed_by
from workbench.decide.presets import TITAN_PRESETS, TITAN_UNTAGGED_MODULES, Rule, preset_rule
from workbench.decide.tags import MUST, SelectorRow, Tag, Why


def selector_matches(module_pattern: str, op_pattern: str, module: str, op: str) -> bool:
    """Whether a selector `MODULE_PATTERN::OP_PATTERN` names an op `op` of module `module`:
    `module_matches` on the path, fnmatch on the op.

    >>> selector_matches("layers.*.attention.**", "aten.mm.*", "layers.0.attention.wq",
    ...                  "aten.mm.default")
    True
    """
    return module_matches(module_pattern, module) and fnmatch.fnmatchcase(op, op_pattern)


def requested(
    facts: OpFacts,
    rule: Rule,
    preset: str,
    selectors: Sequence[SelectorRow],
    overrides: Mapping[str, str],
) -> Tag:
    """What the policy asks for: the preset's choice, then selectors (later ones win), then
    overrides (a key naming one layer wins over a `layers.*` key)."""
    tag = Tag(rule(facts), Why.PRESET, preset)
    for module_pattern, op_pattern, action in selectors:
        if selector_matches(module_pattern, op_pattern, facts.module, facts.op):
            tag = Tag(MUST[action], Why.SELECTOR, f"{module_pattern}::{op_pattern}")
    for key in (facts.key, facts.layer_key):
        if key in overrides:
            tag = Tag(MUST[overrides[key]], Why.OVERRIDE, key)
    return tag


def forced_save(facts: OpFacts) -> Why | None:
    """Graph SAC saves random ops and in-place ops whatever was asked."""
    if facts.random:
        return Why.RANDOM
    if facts.mutation:
        return Why.MUTATION
    return None


def fsdp_tag(reshard: bool) -> Tag:
    """The FSDP choice for a parameter's all-gather: reshard after forward (recompute the
    unshard chain in backward, as FSDP2 and torchtitan do by default) or keep the gathered
    copy from forward to backward."""
    if reshard:
        return Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.FSDP, "reshard after forward")
    return Tag(CheckpointPolicy.MUST_SAVE, Why.FSDP, "keep unsharded")


def decide_ops(
    facts: Sequence[OpFacts],
    preset: str,
    selectors: Sequence[SelectorRow] = (),
    overrides: Mapping[str, str] | None = None,
    fsdp_reshard: bool = True,
    offload: OffloadOptions | None = None,
    plan: DecidePlan | None = None,
) -> dict[str, Tag]:
    """The tag of every node in `facts` (graph order): the request (preset, then the FSDP
    choice on parameter all-gathers, then selectors and overrides), the forced saves, then
    getitems and waits follow the op they unpack or end and unshard chains their
    all-gather, then the layer-boundary rule, then the offload step (`decide_offload`). The
    `titan-*` presets run graph trainer's own variants of these steps (`decide_titan_ops`).
    Pass the facts' `plan` to decide many policies of one graph: the requests before
    overrides are then kept per preset and selector list, so a flip costs a pass over the
    few nodes it can change."""
    plan = plan or decide_plan(facts)
    if preset in TITAN_PRESETS:
        return decide_titan_ops(facts, preset, selectors, overrides, fsdp_reshard, offload, plan)
    requested, followed = _requests(facts, plan, preset, selectors, fsdp_reshard)
    tags, overridden = dict(followed), set()
    for nodes_of in (plan.by_key, plan.by_layer_key):  # a key naming one layer wins
        for key, action in (overrides or {}).items():
            for name in nodes_of.get(key, ()):
                if not requested[name].forced:
                    tags[name] = Tag(MUST[action], Why.OVERRIDE, key)
                    overridden.add(name)
    _follow(tags, requested, plan.leaders, overridden)
    save_layer_boundaries(tags, plan.boundaries)
    save_written_inputs(tags, plan)
    if may_offload(preset, selectors, overrides):
        decide_offload(facts, tags, preset, offload or OffloadOptions(), plan)
    return tags


def _follow(
    tags: dict[str, Tag],
    asked: Mapping[str, Tag],
    leaders: Sequence[tuple[str, str, bool]],
    overridden: set[str] | None = None,
) -> None:
    """Followers take their leader's tag: always on an unshard chain, otherwise where they
    differ on recompute; forced saves stay. `asked`: the tags before this step. With
    `overridden` (nodes whose tags in `tags` are overrides, the rest already followed
    from `asked`), only the followers of changed tags are redone."""
    changed = None if overridden is None else set(overridden)
    for name, leader, chain in leaders:
        if changed is not None:
            if name not in changed and leader not in changed:
                continue
            changed.add(name)
        tag = tags[name] if overridden is not None and name in overridden else asked[name]
        if not tag.forced and (chain or tags[leader].recompute != tag.recompute):
            tag = tags[leader]
        tags[name] = tag


def _requests(
    facts: Sequence[OpFacts],
    plan: DecidePlan,
    preset: str,
    selectors: Sequence[SelectorRow],
    fsdp_reshard: bool,
) -> tuple[dict[str, Tag], dict[str, Tag]]:
    """The tags without overrides, kept in `plan`: forced saves, then the preset's rule,
    the FSDP choice and selectors; and those tags once followers took their leader's."""
    memo_key = (preset, tuple(selectors), fsdp_reshard)
    if memo_key not in plan.requested:
        rule, fsdp = preset_rule(preset), fsdp_tag(fsdp_reshard)
        tags: dict[str, Tag] = {}
        for f in facts:
            forced = forced_save(f)
            if forced is not None:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, forced)
                continue
            tag = requested(f, rule, preset, selectors, {})
            tags[f.name] = fsdp if tag.why is Why.PRESET and f.gather == f.name else tag
        followed = dict(tags)
        _follow(followed, tags, plan.leaders)
        if len(plan.requested) >= REQUEST_MEMO:
            plan.requested.clear()
        plan.requested[memo_key] = (tags, followed)
    return plan.requested[memo_key]


def save_layer_boundaries(
    tags: dict[str, Tag], boundaries: Sequence[tuple[str, tuple[str, ...]]]
) -> None:
    """Save a recomputed node with a recomputed user across a layer boundary (walking
    `layer_boundaries`), naming the first such user."""
    for name, users in boundaries:
        if not tags[name].recompute:
            continue
        for user in users:
            if tags[user].recompute:
                tags[name] = Tag(CheckpointPolicy.MUST_SAVE, Why.LAYER_BOUNDARY, user)
                break


def save_written_inputs(tags: dict[str, Tag], plan: DecidePlan) -> None:
    """Save, in place on `tags`, every node whose recompute would not compute what forward
    computed because of an in-place write (`Why.WRITTEN_INPUT`, `detail` says which):

    - it reads a storage that is not recomputed (a saved node's, a graph input's) and that a
      forward node writes at or after it: in backward the recompute reads the written value,
      and if it is the writer itself, it writes that storage a second time;
    - it reads a storage the recomputation makes anew, that another recomputed node writes,
      with no path of recomputed nodes between the two: torch's remat pass copies nodes in
      batches per backward reader, so only a data path fixes their order.

    Only nodes the remat pass copies into backward count (`replayed_by`). Saving is always
    sound (with nothing recomputed, backward reads what forward made), and each save can
    only end others' reasons or move them to later readers, so the walk repeats until
    nothing changes. Backward ops are assumed not to write forward storages (autograd's
    formulas never do). In-place ops are saved by `forced_save` in the workbench's
    presets; the `titan-*` ones tag them like any op, as graph trainer does."""
    wp = plan.writes
    if not wp.writes:
        return
    while True:
        replayed = replayed_by(tags, plan.by_name)
        for name in wp.readers:
            if replayed(name):
                detail = _written_input(name, tags, plan, replayed)
                if detail is not None:
                    tags[name] = Tag(CheckpointPolicy.MUST_SAVE, Why.WRITTEN_INPUT, detail)
                    break  # the replayed set changed: walk again
        else:
            return


def written_later_keys(plan: DecidePlan) -> frozenset[str]:
    """Layer keys (`layers.3.attention_norm::aten.mean.dim#0`) of the nodes whose output
    storage a later forward node writes in place: what eager SAC may not cache."""
    wp = plan.writes
    return frozenset(
        plan.by_name[name].layer_key
        for name, at in wp.position.items()
        if any(later > at for later, _ in wp.writes.get(wp.root[name], ()))
    )


def _written_input(
    name: str, tags: Mapping[str, Tag], plan: DecidePlan, replayed: Callable[[str], bool]
) -> str | None:
    """Why recomputing `name` would not see what forward saw (`save_written_inputs`)."""
    wp, by_name = plan.writes, plan.by_name
    here = wp.position[name]
    for x in by_name[name].inputs:
        storage = wp.root.get(x, x)
        if storage not in wp.writes:
            continue
        made = x  # where the recomputation gets the storage: follow recomputed aliases
        while made in by_name and tags[made].recompute and by_name[made].alias is not None:
            made = by_name[made].alias  # type: ignore[assignment]
        if made not in by_name or not tags[made].recompute:  # forward's own storage
            later = [w for at, w in wp.writes[storage] if at >= here]
            if later and later[0] == name:
                return (
                    f"{name} writes {x}, which is not recomputed: its recompute in backward "
                    "would write it a second time"
                )
            if later:
                return (
                    f"reads {x}, which {later[0]} writes in place later in forward: its "
                    "recompute in backward would read the written value"
                )
            continue
        for at, writer in wp.writes[storage]:
            if writer == name or not replayed(writer):
                continue
            first, then = (name, writer) if here < at else (writer, name)
            if not _reads_through_recomputed(then, first, tags, plan):
                return (
                    f"reads the storage recomputed {made} makes, which recomputed {writer} "
                    "writes in place with no data path between them: torch's remat pass "
                    "may replay them in another order"
                )
    return None


def _reads_through_recomputed(
    then: str, first: str, tags: Mapping[str, Tag], plan: DecidePlan
) -> bool:
    """Whether `then` reads `first` through recomputed nodes only, so that torch's remat
    pass must copy `first` before `then` (it gathers recomputed inputs depth first)."""
    by_name, stop = plan.by_name, plan.writes.position[first]
    todo, seen = [then], {then}
    while todo:
        for x in by_name[todo.pop()].inputs:
            if x == first:
                return True
            if x in by_name and x not in seen and tags[x].recompute:
                if plan.writes.position[x] > stop:
                    seen.add(x)
                    todo.append(x)
    return False


def decide_titan_ops(
    facts: Sequence[OpFacts],
    preset: str,
    selectors: Sequence[SelectorRow] = (),
    overrides: Mapping[str, str] | None = None,
    fsdp_reshard: bool = True,
    offload: OffloadOptions | None = None,
    plan: DecidePlan | None = None,
) -> dict[str, Tag]:
    """Graph trainer's `tag_sac_policy` on the facts (graph order): `lm_head*`/`loss*`
    nodes untagged, getitems and waits take their parent's tag, the rest the request; then,
    in graph order, a recomputed node with a recomputed user in a higher layer is saved.
    Random ops are saved whatever was asked, as in every graph SAC preset here: torch's
    remat pass refuses them (on the CPU, graph trainer's `default` and `eager` recompute
    SDPA). Without `fsdp_reshard` (its `fsdp_reshard_after_forward="never"`), `titan-default`
    saves the unshard chains from their all-gather on (graph trainer saves the chain's last
    non-view node: the same bytes); its `full` and `eager` ignore that option."""
    rule, overrides = preset_rule(preset), overrides or {}
    leave, untagged = preset_rule("none"), Tag(CheckpointPolicy.PREFER_SAVE, Why.UNTAGGED, "")
    keep = not fsdp_reshard and preset == "titan-default"
    gathered: set[str] = set()
    tags: dict[str, Tag] = {}
    for f in facts:
        if keep and (f.gather == f.name or f.gather in gathered):
            gathered.add(f.name)
            tags[f.name] = fsdp_tag(False)
            continue
        if f.module.startswith(TITAN_UNTAGGED_MODULES):
            tag = requested(f, leave, preset, selectors, overrides)
            detail = f"{f.module} (graph trainer never tags lm_head*/loss* modules)"
            tags[f.name] = untagged._replace(detail=detail) if tag.why is Why.PRESET else tag
            continue
        if f.parent is not None:
            tags[f.name] = tags.get(f.parent, untagged)
            continue
        tag = requested(f, rule, preset, selectors, overrides)
        if f.random and tag.recompute:
            tag = Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
        tags[f.name] = tag
    plan = plan or decide_plan(facts)
    save_layer_boundaries(tags, plan.titan_boundaries)
    save_written_inputs(tags, plan)
    if may_offload(preset, selectors, overrides):
        decide_offload(facts, tags, preset, offload or OffloadOptions(), plan)
    return tags


def eager_tag(
    facts: OpFacts,
    rule: Rule,
    preset: str,
    selectors: Sequence[SelectorRow],
    overrides: Mapping[str, str],
    written_later: Collection[str] = frozenset(),
) -> Tag:
    """Eager SAC's decision for one op as it runs. In-place ops come first and are
    recomputed: eager SAC caches an op's output before autograd bumps an in-place op's
    version, so a saved in-place op fails in backward ("Tensor cached during selective
    activation checkpoint has been mutated"); its recompute mutates a fresh tensor, and
    checkpoint restores the RNG state, so a random in-place op (`bernoulli_`) replays exactly.
    Other random ops are saved, as in the graph; eager SAC cannot offload, so an offload
    request is saved (`Why.OFFLOAD_REFUSED`). An op whose output forward writes in place
    later (its layer key in `written_later`, from `written_later_keys` of a traced graph) is
    recomputed for the same reason as an in-place op: torch's SAC refuses a cached tensor
    that was written after it was cached."""
    if facts.mutation:
        return Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.MUTATION)
    if facts.random:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
    tag = requested(facts, rule, preset, selectors, overrides)
    if tag.offload:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, "eager SAC cannot offload")
    if not tag.recompute and facts.layer_key in written_later:
        detail = "forward writes its output in place later: eager SAC recomputes it"
        return Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.WRITTEN_INPUT, detail)
    return tag
