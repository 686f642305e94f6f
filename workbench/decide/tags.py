"""A decision and why: `Tag` (a `CheckpointPolicy` with its `Why`), the three actions and
the tag each request writes.

Entry points: `Tag`, `Why`, `MUST`, `DECISIONS`, `SelectorRow`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

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


class Tag(NamedTuple):
    """A node's checkpoint policy and why; `detail` is the preset name, the selector, the
    override key or the boundary-crossing user."""

    policy: CheckpointPolicy
    why: Why
    detail: str = ""

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
    def explanation(self) -> str:
        """Why, in words: `preset:eager`, `selector:S`, `layer boundary (recomputed user ...)`,
        `offload refused: ...`."""
        if self.forced:
            return self.why.value + _FORCED_WORDS[self.why].format(self.detail)
        if self.why is Why.OFFLOAD_REFUSED:
            return f"{self.why.value}: {self.detail}"
        return f"{self.why.value}:{self.detail}"

    @property
    def reason(self) -> str:
        """`explanation`, marked `forced:` for the decisions no request can change."""
        return f"forced:{self.explanation}" if self.forced else self.explanation


# (module pattern, op pattern, action), later ones win.
SelectorRow = tuple[str, str, str]
