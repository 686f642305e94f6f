"""Stand-ins for the constants an export writes for one policy, so that the templates
type-check: the generated file defines each of these names with the policy's own value.

Entry points: the names below; `WRAPPED_MARKER` is the one value every export shares.
"""

from __future__ import annotations

# every Python export
PRESET = "default"
SELECTORS: list[tuple[str, str, str]] = []
OVERRIDES: dict[str, str] = {}

# `policy_fn` (eager SAC)
WRAP_LAYERS = True
# Set on a block by the generated `apply_ac`, so a model is never checkpointed twice.
WRAPPED_MARKER = "_sac_workbench_checkpointed"
WRITTEN_LATER: frozenset[str] = frozenset()
# The module path of the blocks `apply_ac` checkpoints: the container the graph was traced with.
LAYERS_ATTR = "layers"

# `graph_pass`
FSDP_RESHARD = True
OFFLOAD_OPTIONS: tuple[int | None, int, int] = (None, 1, 0)
