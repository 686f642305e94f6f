"""A decision and why: `Tag` (a `CheckpointPolicy` with its `Why`), the three actions and
the tag each request writes, and why an offload is refused (`Refused`), as values.

Entry points: `Tag`, `Why`, `MUST`, `DECISIONS`, `SelectorRow`, `Refusal`, `Refused`.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


OFFLOAD = (CheckpointPolicy.PREFER_CPU_OFFLOAD, CheckpointPolicy.MUST_CPU_OFFLOAD)


# The three decisions a forward activation can have, and the tag each request writes.
DECISIONS = ("save", "recompute", "offload")


MUST = {
    "save": CheckpointPolicy.MUST_SAVE,
    "recompute": CheckpointPolicy.MUST_RECOMPUTE,
    "offload": CheckpointPolicy.MUST_CPU_OFFLOAD,
}


class Why(enum.Enum):
    """Why a node has its tag. The last four are forced (`forced`): no request can undo them.
    They are saves in graph SAC; eager SAC recomputes in-place ops and what they write."""

    PRESET = "preset"
    SELECTOR = "selector"
    OVERRIDE = "override"
    FSDP = "fsdp"  # the policy's reshard-after-forward choice on a parameter all-gather
    PARTITIONER = "partition"  # a partitioner's choice replayed as tags (the studies)
    UNTAGGED = "untagged"  # left without a tag, as torchtitan's graph trainer leaves it
    # An offload request the rules cannot grant (a view, the last layer, over the budget,
    # ...): saved instead, `detail` says why. Not forced: the node may still be recomputed.
    OFFLOAD_REFUSED = "offload refused"
    RANDOM = "random op"
    MUTATION = "mutates its input"
    LAYER_BOUNDARY = "layer boundary"
    # A recompute that would not see what forward saw: it writes a storage that is not
    # recomputed, reads one written after it, or could be replayed out of order with a
    # write (`save_written_inputs`; `detail` names the nodes).
    WRITTEN_INPUT = "written in place"

    @property
    def forced(self) -> bool:
        return self in (Why.RANDOM, Why.MUTATION, Why.LAYER_BOUNDARY, Why.WRITTEN_INPUT)


_FORCED_WORDS = {
    Why.RANDOM: " (nondeterministic_seeded); torch's remat pass cannot replay RNG",
    Why.MUTATION: "; recomputing would apply the mutation twice",
    Why.LAYER_BOUNDARY: " (recomputed user {} is in another layer)",
    Why.WRITTEN_INPUT: " ({})",
}


class Refusal(enum.Enum):
    """Why a node's output is not offloaded; the value is its sentence, the end of one that
    starts with the node's name, with `{}` marks for the values a `Refused` carries. One
    vocabulary for the three checks: the rules (`offloadable.offload_refusal`, on facts,
    before remat), `workbench.rewrite.offload.offload_pass` (on the rematerialized graph) and
    its replay on indices (`workbench.cost.replay.offload_order`), both through
    `offloadable.examine_offload`, so a node refused twice is refused alike."""

    NOT_FORWARD = "is not a forward node of this graph"
    NOT_ONE_TENSOR = "returns no single tensor"
    FSDP_CHAIN = "is part of a parameter's FSDP all-gather chain"
    COLLECTIVE = "is a collective or its wait"
    OUTSIDE_LAYERS = "is outside the layers"
    LAST_LAYER = "is in the last layer ({}): backward reads it at once"  # the layer
    VIEW_OP = "is a view op"
    RANDOM = "is a random op"
    WRITTEN = "has its storage written in place in forward"
    WRITTEN_BY = "has its storage written in place in forward by {}"  # the pass knows who
    ALIAS = "is a view or alias of another node's storage: offloading it frees nothing"
    RETURNED = "is returned by the step"
    NOT_CONTIGUOUS = "is not contiguous"
    TOO_SMALL = "is {} bytes, under the {}-byte minimum"  # its bytes, the minimum
    NOT_READ = "is not read in backward after remat: nothing to offload"
    OVER_BUDGET = "over the offload budget of {} bytes ({} already offloaded)"
    EAGER_SAC = "eager SAC cannot offload"


class Refused(NamedTuple):
    """An offload refused, as a value: why, and the values its sentence names (a layer, a
    node, byte counts). Put into words at the edge, by `words`, and nowhere else.

    >>> Refused(Refusal.LAST_LAYER, (5,)).words
    'is in the last layer (5): backward reads it at once'
    """

    why: Refusal
    values: tuple[Any, ...] = ()

    @property
    def words(self) -> str:
        """The sentence: the refusal's, its `{}` marks filled with `values` in order."""
        return self.why.value.format(*self.values)


class Tag(NamedTuple):
    """A node's checkpoint policy and why; `detail` is the preset name, the selector, the
    override key, the boundary-crossing user, or, for `Why.OFFLOAD_REFUSED`, the `Refused`."""

    policy: CheckpointPolicy
    why: Why
    detail: str | Refused = ""

    @property
    def recompute(self) -> bool:
        return self.policy in RECOMPUTE

    @property
    def offload(self) -> bool:
        return self.policy in OFFLOAD

    @property
    def action(self) -> str:
        """`save`, `recompute` or `offload`: the decision in one word."""
        return "recompute" if self.recompute else "offload" if self.offload else "save"

    @property
    def forced(self) -> bool:
        return self.why.forced

    @property
    def detail_words(self) -> str:
        """`detail` as words (a `Refused` said by its `words`)."""
        return self.detail.words if isinstance(self.detail, Refused) else self.detail

    @property
    def explanation(self) -> str:
        """Why, in words: `preset:eager`, `selector:S`, `layer boundary (recomputed user ...)`,
        `offload refused: ...`."""
        if self.forced:
            return self.why.value + _FORCED_WORDS[self.why].format(self.detail_words)
        if isinstance(self.detail, Refused):
            return f"{self.why.value}: {self.detail_words}"
        return f"{self.why.value}:{self.detail_words}"

    @property
    def reason(self) -> str:
        """`explanation`, marked `forced:` for the decisions no request can change."""
        return f"forced:{self.explanation}" if self.forced else self.explanation


# (module pattern, op pattern, action), later ones win.
SelectorRow = tuple[str, str, str]
