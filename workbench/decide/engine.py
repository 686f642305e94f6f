"""Deciding: every forward node's tag, step by step, for graph SAC and eager SAC.

Entry points: `Request` (what a policy asks), `decide_ops(facts, request)` (the steps of the
preset's dialect: the workbench's, or graph trainer's in `decide_titan_ops`) and
`eager_tag(facts, rule, request)` (eager SAC's `policy_fn`). `STEPS_OF` names, per dialect, the
functions its decider takes its steps with, in order, in words.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.ops import module_matches
from workbench.decide.facts import OpFacts
from workbench.decide.offloadable import OffloadOptions, decide_offload, may_offload
from workbench.decide.presets import (
    GRAPH_TRAINER,
    TITAN_UNTAGGED_MODULES,
    WORKBENCH,
    Dialect,
    Rule,
    preset_record,
    preset_rule,
)
from workbench.decide.tables import (
    REQUEST_MEMO,
    DecideTables,
    TitanRequests,
    decide_tables,
    replayed_by,
)
from workbench.decide.tags import MUST, Refusal, Refused, SelectorRow, Tag, Why


class Request(NamedTuple):
    """What a policy asks of the rules (`Policy.request()`): a preset, selectors (later ones
    win), overrides by node key (a key naming one layer wins over a `layers.*` key), the FSDP
    choice on parameter all-gathers (reshard after forward or keep unsharded) and how
    offloaded activations move."""

    preset: str
    selectors: Sequence[SelectorRow] = ()
    overrides: Mapping[str, str] = MappingProxyType({})
    fsdp_reshard: bool = True
    offload: OffloadOptions = OffloadOptions()


def selector_matches(module_pattern: str, op_pattern: str, module: str, op: str) -> bool:
    """Whether a selector `MODULE_PATTERN::OP_PATTERN` names an op `op` of module `module`:
    `module_matches` on the path, fnmatch on the op.

    >>> selector_matches("layers.*.attention.**", "aten.mm.*", "layers.0.attention.wq",
    ...                  "aten.mm.default")
    True
    """
    return module_matches(module_pattern, module) and fnmatch.fnmatchcase(op, op_pattern)


def requested(facts: OpFacts, rule: Rule, request: Request) -> Tag:
    """What the policy asks for: the preset's choice (`rule`, a fresh one of the request's
    preset), then selectors (later ones win), then overrides (a key naming one layer wins
    over a `layers.*` key)."""
    tag = Tag(rule(facts), Why.PRESET, request.preset)
    for module_pattern, op_pattern, action in request.selectors:
        if selector_matches(module_pattern, op_pattern, facts.module, facts.op):
            tag = Tag(MUST[action], Why.SELECTOR, f"{module_pattern}::{op_pattern}")
    for key in (facts.key, facts.layer_key):
        if key in request.overrides:
            tag = Tag(MUST[request.overrides[key]], Why.OVERRIDE, key)
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
    copy from forward to backward (the whole chain saved; graph trainer saves only the node
    holding the unsharded value, `titan_keep_unsharded`)."""
    if reshard:
        return Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.FSDP, "reshard after forward")
    return Tag(CheckpointPolicy.MUST_SAVE, Why.FSDP, "keep unsharded")


class Step(NamedTuple):
    """One step of deciding: the function that takes it and what it does, in words. `STEPS`
    and `TITAN_STEPS` list them in the order the deciders run them (a test reads the
    deciders' code for that order); `policy explain` prints the words."""

    function: Callable[..., Any]
    words: str


def decide_ops(
    facts: Sequence[OpFacts], request: Request, tables: DecideTables | None = None
) -> dict[str, Tag]:
    """The tag of every node in `facts` (graph order) under `request`, by the steps of
    `STEPS` in order: forced saves, the request (the preset, selectors, the FSDP choice on
    parameter all-gathers), followers (getitems, waits, unshard chains), overrides, the
    layer-boundary rule, the in-place rule, then the offload step (`decide_offload`).
    Presets of graph trainer's dialect run its own variants of these steps
    (`decide_titan_ops`). Pass the facts' `tables` to decide many policies of one graph: the
    requests before overrides are then kept per preset and selector list, so a flip costs a
    pass over the few nodes it can change."""
    tables = tables or decide_tables(facts)
    preset = preset_record(request.preset)
    if preset.dialect == GRAPH_TRAINER:
        return decide_titan_ops(facts, request, tables)
    asked, followed = _requests(facts, tables, request)
    tags = dict(followed)
    overridden = apply_overrides(tags, asked, tables, request.overrides)
    follow_leaders(tags, asked, tables.leaders, overridden)
    save_layer_boundaries(tags, tables.boundaries[WORKBENCH])
    save_written_inputs(tags, tables)
    if may_offload(request.preset, request.selectors, request.overrides):
        decide_offload(facts, tags, preset, request.offload, tables)
    return tags


def follow_leaders(
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
    facts: Sequence[OpFacts], tables: DecideTables, request: Request
) -> tuple[dict[str, Tag], dict[str, Tag]]:
    """The tags without overrides, kept in `tables`: forced saves, then the preset's rule and
    selectors, the FSDP choice; and those tags once followers took their leader's."""
    memo_key = (request.preset, tuple(request.selectors), request.fsdp_reshard)
    if memo_key not in tables.request_memo:
        rule = preset_rule(request.preset)
        no_overrides = request._replace(overrides=MappingProxyType({}))
        tags: dict[str, Tag] = {}
        for f in facts:
            forced = forced_save(f)
            if forced is not None:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, forced)
                continue
            tag = requested(f, rule, no_overrides)
            if tag.why is Why.PRESET and f.gather == f.name:
                tag = fsdp_tag(request.fsdp_reshard)
            tags[f.name] = tag
        followed = dict(tags)
        follow_leaders(followed, tags, tables.leaders)
        if len(tables.request_memo) >= REQUEST_MEMO:
            tables.request_memo.clear()
        tables.request_memo[memo_key] = (tags, followed)
    return tables.request_memo[memo_key]


def apply_overrides(
    tags: dict[str, Tag],
    asked: Mapping[str, Tag],
    tables: DecideTables,
    overrides: Mapping[str, str],
) -> set[str]:
    """Overrides, in place on `tags`: `layers.*` keys, then keys naming one layer, which
    win; a forced save in `asked` (the tags before this step) stays. Returns the nodes
    overridden."""
    overridden: set[str] = set()
    for nodes_of in (tables.by_key, tables.by_layer_key):  # a key naming one layer wins
        for key, action in overrides.items():
            for name in nodes_of.get(key, ()):
                if not asked[name].forced:
                    tags[name] = Tag(MUST[action], Why.OVERRIDE, key)
                    overridden.add(name)
    return overridden


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


def save_written_inputs(tags: dict[str, Tag], tables: DecideTables) -> None:
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
    wt = tables.writes
    if not wt.writes:
        return
    while True:
        replayed = replayed_by(tags, tables.by_name)
        for name in wt.readers:
            if replayed(name):
                detail = _written_input(name, tags, tables, replayed)
                if detail is not None:
                    tags[name] = Tag(CheckpointPolicy.MUST_SAVE, Why.WRITTEN_INPUT, detail)
                    break  # the replayed set changed: walk again
        else:
            return


def written_later_keys(tables: DecideTables) -> frozenset[str]:
    """Layer keys (`layers.3.attention_norm::aten.mean.dim#0`) of the nodes whose output
    storage a later forward node writes in place: what eager SAC may not cache."""
    wt = tables.writes
    return frozenset(
        _dispatched(tables, name).layer_key
        for name, at in wt.position.items()
        if any(later > at for later, _ in wt.writes.get(wt.root[name], ()))
    )


def _dispatched(tables: DecideTables, name: str) -> OpFacts:
    """The op eager SAC sees for `name`: a getitem's is the multi-output op it unpacks
    (`aten.topk`, not `getitem#0`: getitem is Python unpacking, never dispatched)."""
    facts = tables.by_name[name]
    while facts.op == "getitem" and facts.parent in tables.by_name:
        facts = tables.by_name[facts.parent]
    return facts


def _written_input(
    name: str, tags: Mapping[str, Tag], tables: DecideTables, replayed: Callable[[str], bool]
) -> str | None:
    """Why recomputing `name` would not see what forward saw (`save_written_inputs`)."""
    wt, by_name = tables.writes, tables.by_name
    here = wt.position[name]
    for x in by_name[name].inputs:
        storage = wt.root.get(x, x)
        if storage not in wt.writes:
            continue
        made = x  # where the recomputation gets the storage: follow recomputed aliases
        while made in by_name and tags[made].recompute and by_name[made].alias is not None:
            made = by_name[made].alias  # type: ignore[assignment]
        if made not in by_name or not tags[made].recompute:  # forward's own storage
            later = [w for at, w in wt.writes[storage] if at >= here]
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
        for at, writer in wt.writes[storage]:
            if writer == name or not replayed(writer):
                continue
            first, then = (name, writer) if here < at else (writer, name)
            if not _reads_through_recomputed(then, first, tags, tables):
                return (
                    f"reads the storage recomputed {made} makes, which recomputed {writer} "
                    "writes in place with no data path between them: torch's remat pass "
                    "may replay them in another order"
                )
    return None


def _reads_through_recomputed(
    then: str, first: str, tags: Mapping[str, Tag], tables: DecideTables
) -> bool:
    """Whether `then` reads `first` through recomputed nodes only, so that torch's remat
    pass must copy `first` before `then` (it gathers recomputed inputs depth first)."""
    by_name, stop = tables.by_name, tables.writes.position[first]
    todo, seen = [then], {then}
    while todo:
        for x in by_name[todo.pop()].inputs:
            if x == first:
                return True
            if x in by_name and x not in seen and tags[x].recompute:
                if tables.writes.position[x] > stop:
                    seen.add(x)
                    todo.append(x)
    return False


_WRITTEN_WORDS = (
    "a recomputed node whose recompute would not see what forward saw is saved (written in "
    "place): it writes a storage that is not recomputed, reads one that forward writes in "
    "place after it, or could be replayed out of order with a recomputed write"
)

# The steps of `decide_ops`, in order.
STEPS: tuple[Step, ...] = (
    Step(
        forced_save,
        "random ops are saved, whatever was asked: torch's remat pass cannot replay their "
        "RNG; so are in-place ops: a recompute would apply the mutation twice",
    ),
    Step(requested, "the other nodes: the preset's rule asks, then selectors (later ones win)"),
    Step(
        fsdp_tag,
        "a parameter's FSDP all-gather (per-rank graphs) that no selector names takes the "
        "policy's FSDP choice: reshard after forward (recomputed in backward) or keep "
        "unsharded (saved)",
    ),
    Step(
        follow_leaders,
        "followers take their leader's tag: a getitem the op it unpacks and a wait_tensor "
        "its collective where the two differ on recompute, every node of a parameter's "
        "unshard chain (cast, all-gather, wait, views) its all-gather; forced saves stay",
    ),
    Step(
        apply_overrides,
        "overrides win over the request and the FSDP choice (a key naming one layer wins "
        "over a `layers.*` key), not over forced saves; the followers of what they changed "
        "follow again",
    ),
    Step(
        save_layer_boundaries,
        "a recomputed node with a recomputed user in another layer is saved (layer boundary)",
    ),
    Step(save_written_inputs, _WRITTEN_WORDS),
    Step(
        decide_offload,
        "offload: the `offload` preset offloads each saved node that may be offloaded, "
        "offload requests the rules cannot grant are saved with the reason, then the budget, "
        "largest first",
    ),
)


def decide_titan_ops(
    facts: Sequence[OpFacts], request: Request, tables: DecideTables | None = None
) -> dict[str, Tag]:
    """Graph trainer's `tag_sac_policy` on the facts (graph order), by the steps of
    `TITAN_STEPS` in order: per node, the first of `lm_head*`/`loss*` nodes untagged, the
    FSDP keep (presets that keep unshards, `Preset.keeps_unsharded`: `titan-default` and
    `titan-sac_and_offload`, without `fsdp_reshard`, its `fsdp_reshard_after_forward="never"`),
    getitems and waits taking their parent's tag, the request; then, in graph order, a
    recomputed node with a recomputed user in a higher layer is saved, then the in-place
    rule and the offload step. Random ops are saved whatever was asked, as in every graph
    SAC preset here: torch's remat pass refuses them (on the CPU, graph trainer's `default`
    and `eager` recompute SDPA). Pass the facts' `tables` to decide many policies of one
    graph: a flip then re-tags only the nodes it overrides and their followers
    (`_titan_requests`)."""
    tables = tables or decide_tables(facts)
    tags = _titan_requests(facts, request, tables)
    save_layer_boundaries(tags, tables.boundaries[GRAPH_TRAINER])
    save_written_inputs(tags, tables)
    if may_offload(request.preset, request.selectors, request.overrides):
        decide_offload(facts, tags, preset_record(request.preset), request.offload, tables)
    return tags


def _titan_requests(
    facts: Sequence[OpFacts], request: Request, tables: DecideTables
) -> dict[str, Tag]:
    """Graph trainer's per-node tags (`_titan_tag`), a fresh dict. Kept in `tables` per
    preset, selectors and FSDP keep (`TitanRequests`): what the preset's rule answered for
    each node it was asked of (a rule may count the nodes it sees, as graph trainer's
    `eager` counts matmuls; an override changes the tag a node gets, not which nodes the
    rule is asked of), and the last overrides' tags. A flip changes one override, so only
    the nodes named by the overrides that changed and their followers are tagged again, in
    graph order, from the kept answers."""
    preset = preset_record(request.preset)
    keep = not request.fsdp_reshard and preset.keeps_unsharded
    memo_key = (request.preset, tuple(request.selectors), keep)
    if memo_key not in tables.titan_memo:
        rule, answers = preset.rule(), dict[str, CheckpointPolicy]()

        def recording(f: OpFacts) -> CheckpointPolicy:
            answers[f.name] = answer = rule(f)
            return answer

        plain = request._replace(overrides=MappingProxyType({}))
        base: dict[str, Tag] = {}
        for f in facts:
            base[f.name] = _titan_tag(f, base, recording, plain, keep)
        if len(tables.titan_memo) >= REQUEST_MEMO:
            tables.titan_memo.clear()
        tables.titan_memo[memo_key] = TitanRequests(answers, {}, base)
    memo = tables.titan_memo[memo_key]
    changed = {
        key
        for key in memo.overrides.keys() | request.overrides.keys()
        if memo.overrides.get(key) != request.overrides.get(key)
    }
    if changed:
        kept_answers = memo.answers

        def kept(f: OpFacts) -> CheckpointPolicy:
            return kept_answers[f.name]

        tags = dict(memo.tags)
        redo = _named_and_followers(tables, changed)
        for name in sorted(redo, key=tables.writes.position.__getitem__):
            tags[name] = _titan_tag(tables.by_name[name], tags, kept, request, keep)
        memo = tables.titan_memo[memo_key] = memo._replace(
            overrides=dict(request.overrides), tags=tags
        )
    return dict(memo.tags)


def _titan_tag(
    f: OpFacts, tags: Mapping[str, Tag], rule: Rule, request: Request, keep: bool
) -> Tag:
    """The first of graph trainer's per-node steps that answers; `tags` holds the nodes
    before `f`."""
    tag = titan_untagged(f, request)
    if tag is None and keep:
        tag = titan_keep_unsharded(f)
    if tag is None:
        tag = titan_follows(f, tags)
    if tag is None:
        tag = titan_request(f, rule, request)
    return tag


def _named_and_followers(tables: DecideTables, keys: Collection[str]) -> set[str]:
    """The nodes override keys name, and the getitems and waits that follow them, at any
    depth."""
    todo = [
        n for key in keys for n in (*tables.by_key.get(key, ()), *tables.by_layer_key.get(key, ()))
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(tables.followers.get(name, ()))
    return seen


# Graph trainer's steps on one node, in the order `decide_titan_ops` asks them: the first
# that answers (not None) gives the node its tag.


def titan_keep_unsharded(f: OpFacts) -> Tag | None:
    """Without reshard after forward, graph trainer saves the node that holds a parameter's
    unsharded value (`OpFacts.unshard_output`: the chain's wait, or the cat of a split/cat
    fanout) and tags the rest of the chain like any node (the views after it recomputed
    from it, the cast and all-gather before it not needed in backward); None for the other
    nodes. The workbench's presets save the whole chain instead (`fsdp_tag`): the same
    bytes in backward (the views alias the saved value, backward reads neither the cast nor
    the all-gather's input), without replaying views, and on chains graph trainer's
    structural walk does not find."""
    return fsdp_tag(False) if f.unshard_output else None


def titan_untagged(f: OpFacts, request: Request) -> Tag | None:
    """Graph trainer tags call_function nodes only, and never `lm_head*` / `loss*` ones (they
    stay saved), though a selector or an override still applies there; None for the others.
    A `get_attr` (a flex attention's score or mask subgraph) holds no tensor: untagged."""
    if f.op == "get_attr":
        return Tag(CheckpointPolicy.PREFER_SAVE, Why.UNTAGGED, "a get_attr, not an op")
    if not f.module.startswith(TITAN_UNTAGGED_MODULES):
        return None
    tag = requested(f, preset_rule("none"), request)
    if tag.why is not Why.PRESET:
        return tag
    detail = f"{f.module} (graph trainer never tags lm_head*/loss* modules)"
    return Tag(CheckpointPolicy.PREFER_SAVE, Why.UNTAGGED, detail)


UNTAGGED = Tag(CheckpointPolicy.PREFER_SAVE, Why.UNTAGGED, "")


def titan_follows(f: OpFacts, tags: Mapping[str, Tag]) -> Tag | None:
    """A getitem or a wait_tensor takes its parent's tag, whatever it is (untagged where
    the parent is not a forward node); None for the other nodes."""
    if f.parent is None:
        return None
    return tags.get(f.parent, UNTAGGED)


def titan_request(f: OpFacts, rule: Rule, request: Request) -> Tag:
    """What the policy asks (`requested`), but a random op is saved: torch's remat pass
    refuses to recompute it."""
    tag = requested(f, rule, request)
    if f.random and tag.recompute:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
    return tag


# The steps of `decide_titan_ops`, in order.
TITAN_STEPS: tuple[Step, ...] = (
    Step(
        titan_untagged,
        "nodes of `lm_head*` / `loss*` modules are left untagged (saved), unless a selector or "
        "override names them",
    ),
    Step(
        titan_keep_unsharded,
        "`titan-default` and `titan-sac_and_offload` without reshard after forward "
        "(`fsdp_reshard_after_forward never`): the node holding a parameter's unsharded "
        "value (its all-gather's wait) is saved; the rest of its chain is tagged as any node",
    ),
    Step(titan_follows, "a getitem or a wait_tensor takes its parent's tag"),
    Step(
        titan_request,
        "the other nodes: the preset's rule asks, then selectors, then overrides; random ops "
        "are saved (on the CPU, where graph trainer recomputes the flash-attention op)",
    ),
    Step(
        save_layer_boundaries,
        "in graph order, a recomputed node with a recomputed user in a *higher* layer is saved "
        "(nodes outside the layers count as layer -1)",
    ),
    Step(
        save_written_inputs,
        _WRITTEN_WORDS + " (graph trainer has no such rule: its run would differ from eager there)",
    ),
    Step(
        decide_offload,
        "`sac_and_offload`: saved contiguous non-view tensors of at least 4 KiB in the layers "
        "but the last are offloaded, largest first within the budget",
    ),
)


def eager_tag(
    facts: OpFacts, rule: Rule, request: Request, written_later: Collection[str] = frozenset()
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
    tag = requested(facts, rule, request)
    if tag.offload:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, Refused(Refusal.EAGER_SAC))
    if not tag.recompute and facts.layer_key in written_later:
        detail = "forward writes its output in place later: eager SAC recomputes it"
        return Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.WRITTEN_INPUT, detail)
    return tag


# Each dialect's steps, in the order its decider takes them (`policy explain` prints them).
STEPS_OF: dict[Dialect, tuple[Step, ...]] = {WORKBENCH: STEPS, GRAPH_TRAINER: TITAN_STEPS}
