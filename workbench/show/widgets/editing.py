"""The explorer's policy edits: a flip, the preset, selectors, overrides, the offload options,
undo and redo, a point of the history restored; each undoable and autosaved.

Entry point: `Editing` (`flip`, `set_preset`, `set_fsdp_reshard`, `add_selector`,
`switch_op`, `remove_selector`, `edit_selector`, `set_override`, `set_offload`, `undo`,
`redo`, `reset`, `load`, `restore`), one of the concerns `ExplorerModel` combines.
"""

from __future__ import annotations

from workbench.decide.decider import decidable, flip, next_action
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.show.widgets.core import ExplorerCore
from workbench.show.widgets.panels import newly_forced, offload_line
from workbench.show.widgets.policy_edits import (
    edited,
    op_switch,
    with_offload,
    with_override,
    with_selector,
    with_selector_action,
    without_selector,
)
from workbench.show.widgets.policy_state import policy_label
from workbench.units import format_count

__all__ = ["Editing"]

_WORDS = {"save": "saved", "recompute": "recomputed", "offload": "offloaded"}


class Editing(ExplorerCore):
    """Every change of policy a user makes: made current (`_change`), said on the message
    line, autosaved."""

    def flip(self, name: str) -> None:
        """Move one op's decision on, save -> recompute -> offload -> save (offload only where
        the rules allow it; the message says why not), in every identical layer when
        `all_layers`."""
        old = self.decisions
        before = old.get(name)
        skipped = None
        if before is not None and name in self.graph.nodes and decidable(self.graph.nodes[name]):
            _, skipped = next_action(self.graph, self.policy, name, self.decisions)
        policy = flip(
            self.graph, self.policy, name, all_layers=self.all_layers, decisions=self.decisions
        )
        self._change(policy)
        after = self.decisions[name]
        if before is not None and after.action == before.action:
            self.message = f"{name} stays {_WORDS[after.action]}: {after.explanation}"
        else:
            where = "in every identical layer" if self.all_layers else "in this layer"
            self.message = f"{name} is now {_WORDS[after.action]} {where}"
        if skipped is not None:
            self.message += f" (offload not offered: {name} {skipped.words})"
        self.message += newly_forced(old, self.decisions, name)
        self._autosave()

    def set_preset(self, name: str) -> None:
        """A new preset under the same selectors and overrides."""
        policy = edited(self.policy, preset=name)
        rows = len(policy.selectors) + len(policy.overrides)
        kept = f", under the same {rows} selectors and overrides" if rows else ""
        self._edit(policy, f"preset {name}{kept}")

    def set_fsdp_reshard(self, reshard: bool) -> None:
        """The FSDP choice of a per-rank graph: reshard after forward (redo each parameter's
        all-gather in backward) or keep the gathered weights unsharded until backward."""
        if not self.has_fsdp:
            raise WorkbenchError(
                f"the graph of {self.graph.model_name!r} has no FSDP parameter all-gathers: "
                "trace it with parallel=Parallel(fsdp=N) (--fsdp N) to choose resharding"
            )
        self._edit(
            edited(self.policy, fsdp_reshard=bool(reshard)),
            "FSDP: reshard after forward (all-gathers redone in backward)"
            if reshard
            else "FSDP: keep unsharded (gathered weights held from forward to backward)",
        )

    def add_selector(self, select: str, action: str) -> None:
        """`MODULE::OP` saved, recomputed or offloaded everywhere it matches (later win)."""
        policy = with_selector(self.graph, self.policy, select, action)
        self._edit(policy, f"added selector: {action} {select}")

    def switch_op(self, module: str, op: str, action: str) -> None:
        """Save or recompute every `op` under `module` (e.g. all aten.mm in attention)."""
        self.add_selector(op_switch(module, op, action), action)

    def remove_selector(self, index: int) -> None:
        policy = without_selector(self.policy, index)
        gone = self.policy.selectors[index]
        self._edit(policy, f"removed selector {index + 1}: {gone.action} {gone.select}")

    def edit_selector(self, index: int, action: str) -> None:
        """Change what selector #index does (save, recompute or offload)."""
        policy = with_selector_action(self.policy, index, action)
        select = policy.selectors[index].select
        self._edit(policy, f"selector {index + 1} now has {select} {_WORDS[action]}")

    def set_override(self, key: str, action: str | None) -> None:
        """Set one override's action, or remove it (`action=None`)."""
        policy = with_override(self.policy, key, action)
        if action is None:
            words = f"removed the override of {key}: its selectors and preset decide it again"
        else:
            words = f"override {key}: now {_WORDS[action]}"
        self._edit(policy, words)

    def set_offload(
        self, budget_bytes: int | None = None, prefetch_layers: int = 1, defer_layers: int = 0
    ) -> None:
        """The policy's offload options: host budget (None: no limit), reload N layers early,
        free the device copy M layers late."""
        policy = with_offload(self.policy, budget_bytes, prefetch_layers, defer_layers)
        self._edit(policy, f"offload options: {offload_line(policy.offload)}")

    def undo(self) -> None:
        self.state.undo()
        self._refresh()
        self.message = f"undone: the policy is {policy_label(self.policy_json)} again"
        self._autosave()

    def redo(self) -> None:
        self.state.redo()
        self._refresh()
        self.message = f"redone: the policy is {policy_label(self.policy_json)} again"
        self._autosave()

    def reset(self) -> None:
        """Back to the preset alone, keeping its FSDP choice (undoable)."""
        rows = len(self.policy.selectors), len(self.policy.overrides)
        words = (
            f"reset to the preset {self.policy.preset} alone: dropped "
            f"{format_count(rows[0], 'selector')} and {format_count(rows[1], 'override')} "
            "(Undo brings them back)"
            if any(rows)
            else f"nothing to reset: the preset {self.policy.preset} has no edits"
        )
        self._edit(edited(self.policy, selectors=[], overrides={}), words)

    def load(self, policy: Policy) -> None:
        """Make `policy` current (undoable, autosaved): a stage's policy set from outside."""
        self._edit(policy, f"loaded policy {policy_label(policy.to_json())}")

    def restore(self, index: int) -> None:
        """Load the policy of a point in the history (undoable), and the host budget its
        offloads were solved for."""
        policy = self.history_log.policy(index)
        self._change(policy)
        self._take_host_budget(policy)
        self.message = f"restored {self.history_log.point(index).name} from the history"
        self._autosave()
