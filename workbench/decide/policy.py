"""Policies: what a user asks for every forward activation (save, recompute or offload), as
a preset, selectors and per-node overrides, in versioned JSON.

Entry points: `Policy` (with `Policy.load` / `save` / `from_json` / `to_json`), `Selector`,
`parse_policy(spec)` and `read_policy_json(path)` (a policy file's checked JSON).
`workbench.decide.decider` applies a policy to a graph.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from workbench.capture.graph import NodeInfo
from workbench.capture.workload import MAX_LAYERS
from workbench.decide.engine import Request, selector_matches
from workbench.decide.offloadable import OffloadOptions, may_offload
from workbench.decide.presets import PRESETS
from workbench.decide.tags import SelectorRow
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.files import MARK_KEY, read_file, write_file

SCHEMA = "sac-workbench/policy"
# 2 added `fsdp_reshard`, 3 the `offload` action and options; a policy is written with the
# lowest version that holds it, so files older workbenches read stay readable by them.
SCHEMA_VERSION = 3

Action = Literal["save", "recompute", "offload"]
ACTIONS: tuple[Action, ...] = ("save", "recompute", "offload")

# Bounds on what a policy file or a widget message may hold: far above any real model's
# paths, far below what would make reading or matching slow.
MAX_SELECTOR_CHARS = 1000
MAX_SELECTORS = 1000  # each is matched against every node: per-node choices are overrides
MAX_POLICY_FILE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Selector:
    """`MODULE_PATTERN::OP_PATTERN` forcing an action; fnmatch per path component, `**`
    matches any number of components (`layers.*.attention.**::aten.mm.default`)."""

    select: str
    action: Action

    def __post_init__(self) -> None:
        if not isinstance(self.select, str):
            raise WorkbenchError(
                f"selector {self.select!r}: select must be a string MODULE_PATTERN::OP_OVERLOAD, "
                f"got {type(self.select).__name__}"
            )
        if len(self.select) > MAX_SELECTOR_CHARS:
            raise WorkbenchError(
                f"selector {self.select[:40]!r}... is {len(self.select)} characters long; "
                f"a selector has at most {MAX_SELECTOR_CHARS}"
            )
        if self.select.count("::") != 1:
            raise WorkbenchError(
                f"selector {self.select!r} must be MODULE_PATTERN::OP_OVERLOAD, "
                "e.g. 'layers.*.attention.wo::aten.mm.default'"
            )
        if not isinstance(self.action, str) or self.action not in ACTIONS:
            raise WorkbenchError(
                f"selector {self.select!r}: action {self.action!r} must be one of {ACTIONS}"
            )

    @classmethod
    def from_json(cls, value: Any) -> Selector:
        """A Selector from itself or its JSON object `{"select": ..., "action": ...}`."""
        if isinstance(value, Selector):
            return value
        if not isinstance(value, dict) or set(value) != {"select", "action"}:
            raise WorkbenchError(
                f"selector {value!r} must be an object with exactly the fields 'select' and "
                "'action'"
            )
        return cls(select=value["select"], action=value["action"])

    @property
    def module_pattern(self) -> str:
        return self.select.split("::")[0]

    @property
    def op_pattern(self) -> str:
        return self.select.split("::")[1]

    def matches(self, info: NodeInfo) -> bool:
        """Whether the selector names this node (`engine.selector_matches`)."""
        return selector_matches(self.module_pattern, self.op_pattern, info.module, info.op)

    def row(self) -> SelectorRow:
        return (self.module_pattern, self.op_pattern, self.action)


@dataclass
class Policy:
    """A preset, then selectors (later ones win), then per-node overrides (layer-specific
    keys win over `layers.*` keys). Keys come from `node_keys(graph)`.

    `fsdp_reshard` decides FSDP parameter all-gathers of per-rank graphs before selectors
    and overrides: True (as FSDP2 and torchtitan's `fsdp_reshard_after_forward="default"`
    without pipeline parallelism) recomputes each unshard chain in backward; False keeps the
    gathered copies from forward to backward."""

    preset: str = "default"
    selectors: list[Selector] = field(default_factory=list)
    overrides: dict[str, Action] = field(default_factory=dict)
    fsdp_reshard: bool = True
    offload: OffloadOptions = field(default_factory=OffloadOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str):
            raise WorkbenchError(
                f"preset {self.preset!r} must be a string, one of {', '.join(PRESETS)}; "
                f"got {type(self.preset).__name__}"
            )
        if self.preset not in PRESETS:
            close = difflib.get_close_matches(self.preset, PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise WorkbenchError(
                f"unknown preset {self.preset!r}{hint}; choose one of {', '.join(PRESETS)}"
            )
        if not isinstance(self.selectors, (list, tuple)):
            raise WorkbenchError(
                "selectors must be a list of {'select': ..., 'action': ...} objects, "
                f"got {type(self.selectors).__name__}"
            )
        if len(self.selectors) > MAX_SELECTORS:
            raise WorkbenchError(
                f"{len(self.selectors)} selectors: a policy has at most {MAX_SELECTORS}; "
                "name single nodes with overrides instead"
            )
        self.selectors = [Selector.from_json(s) for s in self.selectors]
        if not isinstance(self.overrides, dict):
            raise WorkbenchError(
                "overrides must be an object mapping node keys to 'save', 'recompute' or "
                "'offload', "
                f"got {type(self.overrides).__name__}"
            )
        for key, action in self.overrides.items():
            if not isinstance(key, str):
                raise WorkbenchError(f"override key {key!r} must be a string MODULE::OP#k")
            if not isinstance(action, str) or action not in ACTIONS:
                raise WorkbenchError(f"override {key!r}: {action!r} must be one of {ACTIONS}")
        if not isinstance(self.fsdp_reshard, bool):
            raise WorkbenchError(
                f"fsdp_reshard {self.fsdp_reshard!r} must be true (reshard after forward) or "
                "false (keep unsharded)"
            )
        self.offload = offload_options(self.offload)

    def request(self) -> Request:
        """What the policy asks of the rules (`engine.decide_ops`)."""
        return Request(
            preset=self.preset,
            selectors=[s.row() for s in self.selectors],
            overrides=self.overrides,
            fsdp_reshard=self.fsdp_reshard,
            offload=self.offload,
        )

    @property
    def offloads(self) -> bool:
        """Whether the policy can offload anything: an offload preset or request."""
        return may_offload(self.preset, [s.row() for s in self.selectors], self.overrides)

    def without_offload(self) -> Policy:
        """The same policy saving what it offloads: the base preset of an offload preset,
        `save` for offload selectors and overrides (what eager SAC, which cannot offload,
        runs for it)."""
        return dataclasses.replace(
            self,
            preset=PRESETS[self.preset].offloads or self.preset,
            selectors=[
                Selector(s.select, "save" if s.action == "offload" else s.action)
                for s in self.selectors
            ],
            overrides={k: "save" if a == "offload" else a for k, a in self.overrides.items()},
            offload=OffloadOptions(),
        )

    @property
    def version(self) -> int:
        """The lowest schema version that holds this policy."""
        if self.offloads or self.offload != OffloadOptions():
            return 3
        return 1 if self.fsdp_reshard else 2

    def to_json(self) -> dict[str, Any]:
        """The lowest version that holds the policy (`version`), with the fields it adds
        only where they differ from their defaults."""
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "version": self.version,
            "preset": self.preset,
            "selectors": [{"select": s.select, "action": s.action} for s in self.selectors],
            "overrides": dict(sorted(self.overrides.items())),
        }
        if not self.fsdp_reshard:
            data["fsdp_reshard"] = False
        if self.offload != OffloadOptions():
            data["offload"] = self.offload._asdict()
        return data

    def key(self) -> str:
        """Its JSON as one canonical string: equal for equal policies (a cache key).

        >>> Policy("full").key() == Policy("full").key() != Policy("none").key()
        True
        """
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, data: Any, source: str = "policy") -> Policy:
        if not isinstance(data, dict):
            raise WorkbenchError(f"{source}: a policy is a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise WorkbenchError(f"{source}: not a workbench policy (schema must be {SCHEMA!r})")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise WorkbenchError(
                f"{source}: policy version must be a whole number from 1 to {SCHEMA_VERSION}, "
                f"got {version!r} ({type(version).__name__})"
            )
        if version > SCHEMA_VERSION:
            raise WorkbenchError(
                f"{source}: policy schema version {version} is newer than this workbench "
                f"reads (up to {SCHEMA_VERSION}); upgrade sac-workbench"
            )
        fields = {"schema", "version", "preset", "selectors", "overrides", MARK_KEY}
        fields |= {"fsdp_reshard"} if version >= 2 else set()
        fields |= {"offload"} if version >= 3 else set()
        unknown = set(data) - fields
        if unknown:
            raise WorkbenchError(f"{source}: unknown policy fields {sorted(unknown)}")
        overrides = data.get("overrides", {})
        try:
            policy = cls(
                preset=data.get("preset", "default"),
                selectors=data.get("selectors", []),
                overrides=dict(overrides) if isinstance(overrides, dict) else overrides,
                fsdp_reshard=data.get("fsdp_reshard", True),
                offload=data.get("offload", OffloadOptions()),
            )
        except WorkbenchError as err:
            raise WorkbenchError(f"{source}: {err}") from None
        if policy.version > version:
            raise WorkbenchError(
                f"{source}: offload needs policy version 3, the file says {version}"
            )
        return policy

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy file; anything but a readable, UTF-8, reasonably sized and shallow
        JSON policy is refused with one line naming the file and the problem."""
        name = f"policy file {str(path)!r}"
        return cls.from_json(read_policy_json(path), source=name)

    @classmethod
    def from_bytes(cls, raw: bytes, name: str) -> Policy:
        """A policy from a file's bytes (`name` says where they came from in errors)."""
        return cls.from_json(policy_json(raw, name), source=name)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write atomically; an existing file is replaced only when `overwrite` is set."""
        return write_file(path, json.dumps(self.to_json(), indent=2) + "\n", overwrite=overwrite)


class _DuplicateKey(Exception):
    """A JSON object with a key twice (Python's reader would silently take the last)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return data


def read_policy_json(path: str | os.PathLike[str]) -> Any:
    """The JSON a policy file holds, read with every check a policy file gets (`policy_json`):
    one reader for a policy and for a pipeline's file of stage policies."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"Policy.load: path must be a str or os.PathLike, got {path!r}")
    name = f"policy file {str(path)!r}"
    return policy_json(read_file(path, name, MAX_POLICY_FILE_BYTES), name)


def policy_json(raw: bytes, name: str) -> Any:
    """The JSON in a policy file's bytes; anything but UTF-8, reasonably sized, shallow JSON
    without a repeated key is refused with one line naming `name` and the problem."""
    if len(raw) > MAX_POLICY_FILE_BYTES:
        raise WorkbenchError(
            f"{name} is larger than {MAX_POLICY_FILE_BYTES // 2**20} MiB: not a policy"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise WorkbenchError(
            f"{name} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as err:
        raise WorkbenchError(
            f"{name} has the key {err.args[0]!r} twice in one object: JSON readers differ "
            "on which one counts; keep one"
        ) from None
    except json.JSONDecodeError as err:
        raise WorkbenchError(
            f"{name} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        ) from None
    except RecursionError:
        raise WorkbenchError(f"{name} is nested too deeply to be a policy") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise WorkbenchError(f"{name} is not a readable policy: {err}") from None


_OFFLOAD_FIELDS = ", ".join(OffloadOptions._fields)


def offload_options(value: Any) -> OffloadOptions:
    """Checked offload options from themselves or their JSON object. A budget is a positive
    byte count or null (no limit): a budget of 0 would offload nothing, which is a policy
    without offload, so it is refused rather than silently meaning either."""
    if isinstance(value, dict):
        unknown = set(value) - set(OffloadOptions._fields)
        if unknown:
            raise WorkbenchError(
                f"offload: unknown fields {sorted(unknown)}; the fields are {_OFFLOAD_FIELDS}"
            )
        value = OffloadOptions(**value)
    if not isinstance(value, OffloadOptions):
        raise WorkbenchError(
            f"offload must be an object with the fields {_OFFLOAD_FIELDS}, "
            f"got {type(value).__name__}"
        )
    budget = value.budget_bytes
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise WorkbenchError(
            f"offload budget_bytes {budget!r} must be a whole number of bytes or null (no limit)"
        )
    if budget is not None and budget <= 0:
        raise WorkbenchError(
            f"offload budget_bytes {budget} would offload nothing: give a positive byte count, "
            "null for no limit, or a policy that does not offload"
        )
    if budget is not None:
        check_int("offload budget_bytes", budget, 1, INT64_MAX, "int64; null for no limit")
    for name in ("prefetch_layers", "defer_layers"):
        layers = getattr(value, name)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise WorkbenchError(f"offload {name} {layers!r} must be a whole number of layers >= 0")
        check_int(f"offload {name}", layers, 0, MAX_LAYERS, "a model has at most that many")
    return value


def parse_policy(spec: str) -> Policy:
    """A preset name, a policy as JSON text (an object: `{"schema": ...}`) or a path to a
    policy JSON file (the CLI's `--policy`)."""
    if spec in PRESETS:
        return Policy(preset=spec)
    if spec.lstrip().startswith("{"):
        return Policy.from_bytes(spec.encode(), "--policy JSON")
    if spec.endswith(".json") or os.path.sep in spec or Path(spec).exists():
        return Policy.load(spec)
    return Policy(preset=spec)  # raises with the list of presets
