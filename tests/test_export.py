"""Exports: the graph pass reproduces decide() in a fresh interpreter, code is standalone and
safe for any names, torchtitan options map presets honestly, files are never clobbered."""

from __future__ import annotations

import ast
import copy
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    remat_using_tags_for_fwd_loss_bwd_graph,
)

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.workload import eager_step
from workbench.decide.decider import decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy, Selector
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.interop.export import FORMATS, export, py_str, rules_source, write_export
from workbench.interop.graph_notes import comment, forced_notes, parallel_notes
from workbench.interop.templates import constants
from workbench.interop.torchtitan_options import (
    TORCHTITAN_MAIN_COMMIT,
    TORCHTITAN_MAIN_DATE,
    TORCHTITAN_VERSIONS,
    installed_torchtitan,
    torchtitan_options,
)

MODELS = ("llama3-debug", "dsv3-debug")
CUSTOM = Policy(
    "default",
    selectors=[
        Selector("layers.*.feed_forward.**::aten.mm.default", "recompute"),
        Selector("layers.*.attention::aten.mul.Tensor", "save"),
        Selector("layers.0.feed_forward.w[12]::aten.mm.default", "save"),  # later wins
    ],
    overrides={
        "layers.*.attention.wq::aten.mm.default#0": "recompute",
        "layers.1.attention.wq::aten.mm.default#0": "save",  # one layer beats layers.*
        "layers.*.attention_norm::aten.mul.Tensor#1": "save",
        "::aten.slice.Tensor#1": "recompute",  # the root module
        "loss::aten._log_softmax.default#0": "recompute",  # nodes without a module path
    },
)
POLICIES: dict[str, Policy] = {**{name: Policy(name) for name in PRESETS}, "custom": CUSTOM}
NASTY = "layers.*.at'ten\"tion\n\\x\u2028\U0001f600"

# Runs in a fresh interpreter: load every exported module first (they must not pull in the
# workbench), then trace with the workbench and print each module's tags as JSON.
HARNESS = """
import importlib.util, json, sys
modules = {}
for name, path in json.loads(sys.argv[1]).items():
    spec = importlib.util.spec_from_file_location(f"exported_{name}", path)
    modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modules[name])
assert not any(m.split(".")[0] == "workbench" for m in sys.modules), "export imported workbench"
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
out = {}
for model in json.loads(sys.argv[2]):
    graph = trace(load_workload(model, layers=2, seq=32), mode="real")
    out[model] = {
        name: {
            n.name: n.meta["recompute"].name
            for n in module.tag_graph(graph.gm).graph.nodes
            if "recompute" in n.meta
        }
        for name, module in modules.items()
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_tags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("exports")
    files = {}
    for name, policy in POLICIES.items():
        files[name] = str(write_export(export(policy, "graph_pass"), folder / f"{name}.py"))
    run = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(files), json.dumps(MODELS)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def imported_roots(code: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            roots.add(node.module.split(".")[0])
    return roots


def load(code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "exported"}
    exec(compile(code, "<export>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", MODELS)
def test_graph_pass_in_a_fresh_interpreter_tags_what_decide_decides(
    model: str,
    policy: str,
    small_graphs: dict[str, tuple[Workload, JointGraph]],
    fresh_tags: dict[str, Any],
) -> None:
    _, graph = small_graphs[model]
    expected = {name: d.policy.name for name, d in decide(graph, POLICIES[policy]).items()}
    assert fresh_tags[model][policy] == expected


@pytest.mark.parametrize("fmt", ["policy_fn", "graph_pass"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_python_exports_import_only_torch_and_the_stdlib(fmt: str, policy: str) -> None:
    if fmt == "policy_fn" and POLICIES[policy].offloads:
        with pytest.raises(WorkbenchError, match="offload .* is not expressible in eager SAC"):
            export(POLICIES[policy], fmt)
        return
    roots = imported_roots(export(POLICIES[policy], fmt))
    assert "torch" in roots
    assert roots - {"torch", "__future__"} <= set(sys.stdlib_module_names)


def test_exported_graph_pass_feeds_torchs_remat_bitwise(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    tagged = load(export(CUSTOM, "graph_pass"))["tag_graph"](copy.deepcopy(graph.gm))
    out = remat_using_tags_for_fwd_loss_bwd_graph(tagged)
    assert any(n.name.endswith("_recomputed") for n in out.graph.nodes)
    assert graph.example_inputs is not None
    with torch.no_grad():
        result = list(out(*graph.example_inputs))
    assert all(torch.equal(a, b) for a, b in zip(result, eager_step(workload), strict=True))


def test_tag_graph_warns_about_names_it_never_met(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    _, graph = small_graphs["llama3-debug"]
    policy = Policy(
        "full",
        selectors=[Selector("nowhere::aten.mm.default", "save")],
        overrides={"layers.*.attention::aten.mm.default#9": "save"},
    )
    tag_graph = load(export(policy, "graph_pass"))["tag_graph"]
    with pytest.warns(UserWarning) as caught:
        tag_graph(copy.deepcopy(graph.gm))
    messages = " ".join(str(w.message) for w in caught)
    assert "selector nowhere::aten.mm.default matches no node" in messages
    assert "override layers.*.attention::aten.mm.default#9 names no forward node" in messages


def test_generated_code_reads_as_written_tables() -> None:
    code = export(CUSTOM, "policy_fn")
    header = code.split('"""', 2)[2].split("from __future__")[0].strip().splitlines()
    assert header and all(line.startswith("#") for line in header)
    assert json.loads("\n".join(line[4:] for line in header[1:])) == CUSTOM.to_json()
    exported = load(code)
    assert exported["PRESET"] == "default"
    assert exported["SELECTORS"] == [
        (s.module_pattern, s.op_pattern, s.action) for s in CUSTOM.selectors
    ]
    assert exported["OVERRIDES"] == CUSTOM.overrides
    assert "aten.mm.default" in exported["COMPUTE_INTENSIVE_OPS"]
    assert exported["WRAP_LAYERS"] is True
    assert load(export(Policy("none"), "policy_fn"))["WRAP_LAYERS"] is False


@pytest.mark.skipif(
    shutil.which("ruff", path=str(Path(sys.executable).parent)) is None,
    reason="ruff is not installed next to this interpreter",
)
def test_generated_code_passes_ruff(tmp_path: Path) -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff is not None
    nasty = Policy("full", [Selector(f"{NASTY}::aten.mm.default", "save")], {f"{NASTY}#0": "save"})
    long = "layers.*." + "long_module_name." * 6 + "wq::aten.mm.default"
    wide = Policy("default", [Selector(long, "recompute")], {f"{long}#0": "save"})
    for i, policy in enumerate([*POLICIES.values(), nasty, wide]):
        for fmt in ("policy_fn", "graph_pass")[policy.offloads :]:  # no offload in eager
            (tmp_path / f"{fmt}_{i}.py").write_text(export(policy, fmt))
    # The project's rules, except line length: a user's module names can be arbitrarily long.
    check = ["check", "--select", "E,F,W,I,UP,B", "--ignore", "E501"]
    for command in (check, ["format", "--check"]):
        run = subprocess.run(
            [ruff, *command, "--isolated", "--no-cache", "--line-length", "100", str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(
    "text", ["", "plain", NASTY, "'", '"', "\\", '"""', "\x00\x7f\t\r", "é", "a\\nb"]
)
def test_py_str_round_trips_any_string(text: str) -> None:
    literal = py_str(text)
    assert literal.isascii() and "\n" not in literal
    assert ast.literal_eval(literal) == text


def test_comment_lines_cannot_be_ended_early() -> None:
    assert comment("a\nb\\c \u00e9") == "# a\\nb\\\\c \\xe9"


def test_graph_notes_on_one_device(small_graphs: dict[str, tuple[Workload, JointGraph]]) -> None:
    _, graph = small_graphs["llama3-debug"]
    assert parallel_notes(Policy("default"), graph) == []
    notes = forced_notes(Policy("full"), graph)
    assert notes[0].startswith("Forced on this graph, whatever the policy asks: ")
    assert "random op" in notes[0] and "mutates its input" in notes[0]


@pytest.mark.parametrize(
    ("fmt", "template"), [("policy_fn", "eager_sac"), ("graph_pass", "graph_pass")]
)
def test_python_exports_are_their_templates_below_the_policy_and_the_rules(
    fmt: str, template: str
) -> None:
    """The template module's docstring heads the export and its code after the imports ends
    it, verbatim; every constant the templates import from the stub is defined above."""
    source = Path(__file__).resolve().parents[1] / f"workbench/interop/templates/{template}.py"
    tree = ast.parse(source.read_text())
    code = export(Policy("eager"), fmt)
    docstring = ast.get_docstring(tree, clean=False)
    assert code.startswith(f'"""{docstring}"""\n')
    last_import = max(n.end_lineno or 0 for n in tree.body if isinstance(n, ast.ImportFrom))
    body = "\n".join(source.read_text().splitlines()[last_import:]).strip("\n")
    assert code.endswith(f"# --- Entry point ---\n\n\n{body}\n")
    assert rules_source()[1] in code and "from workbench" not in code
    stub = next(
        n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == constants.__name__
    )
    defined = load(code)
    assert all(alias.name in defined for alias in stub.names)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_names_with_quotes_backslashes_and_newlines_cannot_break_the_output(fmt: str) -> None:
    selector = Selector(f"{NASTY}::aten.mm.default", "save")
    policy = Policy("full", selectors=[selector], overrides={f"{NASTY}::aten.mm.default#0": "save"})
    text = export(policy, fmt)  # graph=None: decide() would reject these names
    if fmt == "json":
        assert Policy.from_json(json.loads(text)) == policy
        return
    if fmt == "torchtitan":
        lines = text.splitlines()
        assert all(line.startswith(("#", "--")) for line in lines)
        assert "--compile.memory_policy full" in lines
        assert any("cannot express selector" in line for line in lines)
        return
    exported = load(text)
    assert exported["SELECTORS"] == [(NASTY, "aten.mm.default", "save")]
    assert exported["OVERRIDES"] == {f"{NASTY}::aten.mm.default#0": "save"}
    assert text.isascii()


TORCHTITAN_POLICY = {name: name.removeprefix("titan-") for name in PRESETS}
TORCHTITAN_POLICY["offload"] = "sac_and_offload"
OFFLOAD_OPTIONS = [
    "--compile.cpu_offload_budget_gb 0",
    "--compile.cpu_offload_prefetch_n_layers 1",
    "--compile.cpu_offload_defer_n_layers 1",  # the workbench's default 0: torchtitan refuses 0
]


@pytest.mark.parametrize("version", ["0.3.0", "main"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_torchtitan_options_for_each_preset(preset: str, version: str) -> None:
    lines = torchtitan_options(Policy(preset), version=version).splitlines()
    options = [line for line in lines if not line.startswith("#")]
    if preset == "none":  # neither 0.3.0 nor the main snapshot has a save-everything policy
        assert options == [] and any("cannot express preset 'none'" in x for x in lines)
        return
    offload = OFFLOAD_OPTIONS if Policy(preset).offloads else []
    assert options == [f"--compile.memory_policy {TORCHTITAN_POLICY[preset]}", *offload]
    assert any("graph_trainer/configs.py" in line for line in lines)
    assert not any("cannot express" in line for line in lines)


def test_torchtitan_main_names_its_snapshot() -> None:
    """ "main" is one stated commit of torchtitan's main branch: the export's header says
    which, with its date, and offers only the memory policies that commit accepts."""
    main = TORCHTITAN_VERSIONS["main"]
    text = torchtitan_options(Policy("default"), version="main")
    assert f"main at commit {TORCHTITAN_MAIN_COMMIT} ({TORCHTITAN_MAIN_DATE})" in text
    assert main.memory_policies == ("default", "full", "eager", "sac_and_offload")
    for gone in ("none", "min_cut", "cpu_offload_all", "sac_and_paged_stash"):
        assert gone not in main.memory_policies
    assert TORCHTITAN_MAIN_COMMIT not in torchtitan_options(Policy("default"), version="0.3.0")


def _snapshot_file(path: str) -> str | None:
    """A file of torchtitan's main snapshot, from the git repository named by
    SAC_TORCHTITAN_REPO (a clone of pytorch/torchtitan), or None without one."""
    import os
    import subprocess

    repo = os.environ.get("SAC_TORCHTITAN_REPO", "/work/.mirror/pytorch+torchtitan/repo")
    if not Path(repo).exists():
        return None
    done = subprocess.run(
        ["git", "-C", repo, "show", f"{TORCHTITAN_MAIN_COMMIT}:{path}"],
        capture_output=True,
        text=True,
    )
    return done.stdout if done.returncode == 0 else None


def test_torchtitan_main_is_the_snapshots_config() -> None:
    """The snapshot's own GraphTrainerCompileConfig: the same memory policies, the save-ops
    and offload options the export writes."""
    source = _snapshot_file("torchtitan/experiments/graph_trainer/configs.py")
    if source is None:
        pytest.skip("no clone of pytorch/torchtitan with the snapshot: set SAC_TORCHTITAN_REPO")
    config = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == "GraphTrainerCompileConfig"
    )
    fields = {
        item.target.id: item.annotation
        for item in config.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    choices = ast.literal_eval(fields["memory_policy"].slice)  # type: ignore[attr-defined]
    assert tuple(choices) == TORCHTITAN_VERSIONS["main"].memory_policies
    policy = Policy("titan-sac_and_offload")
    for line in torchtitan_options(policy, version="main").splitlines():
        if line.startswith("--compile."):
            assert line.split()[0].removeprefix("--compile.") in fields
    assert "full_recompute_save_ops" in fields


def test_torchtitan_030_has_no_none_policy_and_no_save_ops_option() -> None:
    lines = torchtitan_options(Policy("none"), version="0.3.0").splitlines()
    assert not any(line.startswith("--") for line in lines)
    assert any("cannot express preset 'none'" in line for line in lines)
    assert any("graph_pass" in line for line in lines)
    policy = Policy("titan-full", selectors=[Selector("layers.*.attention.wo::*", "save")])
    lines = torchtitan_options(policy, version="0.3.0").splitlines()
    assert [line for line in lines if line.startswith("--")] == ["--compile.memory_policy full"]
    assert any("has no --compile.full_recompute_save_ops" in line for line in lines)


def test_torchtitan_version_defaults_to_the_installed_one() -> None:
    text = export(Policy("titan-eager"), "torchtitan")
    installed = installed_torchtitan()
    expected = installed if installed in TORCHTITAN_VERSIONS else "0.3.0"
    assert f"For torchtitan {expected} (" in text
    with pytest.raises(WorkbenchError, match="unknown torchtitan version '0.2'.*0.3.0, main"):
        torchtitan_options(Policy("default"), version="0.2")


def _installed_compile_options() -> dict[str, Any]:
    """Fields of the installed graph trainer's `GraphTrainerCompileConfig` (its own and its
    base `CompileConfig`'s) and the choices of `memory_policy`, read from its source: its
    module imports torchtitan's whole trainer, whose training-only requirements
    (datasets, tensorboard, ...) the test set-up does not install."""
    import dataclasses
    import importlib.util

    from torchtitan.config.configs import CompileConfig

    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0], "experiments/graph_trainer/configs.py")
    tree = ast.parse(path.read_text())
    config = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "GraphTrainerCompileConfig"
    )
    fields: dict[str, Any] = {f.name: None for f in dataclasses.fields(CompileConfig)}
    for item in config.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields[item.target.id] = item.annotation
    choices = ast.literal_eval(fields["memory_policy"].slice)  # Literal["default", ...]
    return {"fields": set(fields), "memory_policy": tuple(choices)}


@pytest.mark.skipif(installed_torchtitan() is None, reason="torchtitan not installed")
@pytest.mark.parametrize("preset", list(PRESETS))
def test_torchtitan_options_exist_in_the_installed_config_class(preset: str) -> None:
    installed = _installed_compile_options()
    version = TORCHTITAN_VERSIONS[installed_torchtitan() or ""]
    assert version.memory_policies == installed["memory_policy"]
    assert version.save_ops_option == ("full_recompute_save_ops" in installed["fields"])
    selectors = [Selector("layers.*.attention.wo::*", "save")]
    for policy in (Policy(preset), Policy(preset, selectors=selectors)):
        for line in export(policy, "torchtitan").splitlines():
            if line.startswith("--"):
                option, value = shlex.split(line)
                assert option.startswith("--compile.")
                assert option.removeprefix("--compile.") in installed["fields"]
                if option == "--compile.memory_policy":
                    assert value in installed["memory_policy"]


def test_torchtitan_full_with_save_selectors_uses_full_recompute_save_ops() -> None:
    selects = ["layers.*.feed_forward.router.gate::aten.mm.default", "layers.*.wo::aten.mm.default"]
    policy = Policy("full", selectors=[Selector(s, "save") for s in selects])
    lines = torchtitan_options(policy, version="main").splitlines()
    option = [line for line in lines if line.startswith("--compile.full_recompute_save_ops")]
    assert len(option) == 1
    assert shlex.split(option[0])[1:] == [" | ".join(selects)]
    assert not any("cannot express" in line for line in lines)


@pytest.mark.parametrize(
    "select, why",
    [("layers.*.attention.wo::*", "is a pattern"), ("**.wo::aten.mm.default", "has '**'")],
)
def test_torchtitan_main_save_ops_take_only_what_graph_trainer_parses(
    select: str, why: str
) -> None:
    """Its parser resolves OP to one overload and matches one component per pattern part."""
    policy = Policy("full", selectors=[Selector(select, "save")])
    lines = torchtitan_options(policy, version="main").splitlines()
    assert not any(line.startswith("--compile.full_recompute_save_ops") for line in lines)
    assert sum("cannot express" in line and why in line for line in lines) == 1


SAVE_THEN_RECOMPUTE = [Selector("layers.*::*", "save"), Selector("layers.*.wo::*", "recompute")]


@pytest.mark.parametrize(
    "policy",
    [
        Policy("eager", overrides={"layers.*.attention.wq::aten.mm.default#0": "save"}),
        Policy("default", selectors=[Selector("layers.*.attention.wo::*", "save")]),
        Policy("full", selectors=SAVE_THEN_RECOMPUTE),
        Policy("eager", selectors=[Selector("layers.*.attention.wo::*", "recompute")]),
    ],
)
def test_torchtitan_says_what_it_cannot_express(policy: Policy) -> None:
    lines = torchtitan_options(policy, version="main").splitlines()
    assert sum("cannot express" in line for line in lines) == 1
    assert any(line.startswith("#") and "graph_pass" in line for line in lines)


def test_json_export_round_trips() -> None:
    for policy in POLICIES.values():
        text = export(policy, "json")
        assert text == json.dumps(policy.to_json(), indent=2)
        assert Policy.from_json(json.loads(text)) == policy


def test_unknown_format_lists_the_formats() -> None:
    with pytest.raises(WorkbenchError, match="'yaml'.*policy_fn, graph_pass, torchtitan, json"):
        export(Policy("full"), "yaml")


def test_export_with_a_graph_validates_the_policy(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    _, graph = small_graphs["llama3-debug"]
    typo = Policy(selectors=[Selector("layers.*.atention.wo::aten.mm.default", "save")])
    with pytest.raises(WorkbenchError, match="no module matches"):
        export(typo, "policy_fn", graph=graph)
    assert "llama3-debug" in export(CUSTOM, "graph_pass", graph=graph)


def test_write_export_never_overwrites_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "policy.py"
    assert write_export("first\n", path) == path
    assert path.read_text().endswith("\nfirst\n")  # after the workbench's mark
    write_export("second\n", path)  # its own unchanged output: replaced
    assert path.read_text().endswith("\nsecond\n")
    path.write_text("first\n")  # the user's now
    with pytest.raises(WorkbenchError, match="exists and was not written by the workbench"):
        write_export("second\n", path)
    assert path.read_text() == "first\n"
    write_export("second\n", path, overwrite=True)
    assert path.read_text().endswith("\nsecond\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.py"]  # no temp files left
    with pytest.raises(WorkbenchError, match="missing"):
        write_export("x", tmp_path / "no" / "such.py")


def test_torchtitan_offload_options_map_the_budget_and_say_what_does_not_map() -> None:
    policy = Policy(
        "offload",
        overrides={"layers.*.attention.wq::aten.mm.default#0": "offload"},
        offload=OffloadOptions(budget_bytes=3 * 2**29, prefetch_layers=2, defer_layers=1),
    )
    lines = torchtitan_options(policy, version="0.3.0").splitlines()
    assert [line for line in lines if line.startswith("--")] == [
        "--compile.memory_policy sac_and_offload",
        "--compile.cpu_offload_budget_gb 1.5",
        "--compile.cpu_offload_prefetch_n_layers 2",
        "--compile.cpu_offload_defer_n_layers 1",
    ]
    assert any("cannot express override layers.*.attention.wq" in line for line in lines)
    assert any("1610612736 bytes = 1.5 GiB" in line for line in lines)
    # offload asked by name on a preset without offload: the options stay unsaid
    asked = Policy("default", selectors=[Selector("layers.*.attention.wo::*", "offload")])
    lines = torchtitan_options(asked, version="0.3.0").splitlines()
    assert [line for line in lines if line.startswith("--")] == ["--compile.memory_policy default"]
    assert any("own rules (sac_and_offload)" in line for line in lines)


def test_torchtitan_export_asks_for_defer_1_where_the_policy_says_0() -> None:
    """torchtitan 0.3.0's offload pass refuses defer 0 (tests/test_titan.py): the export
    asks for 1 and says that it frees later than the policy."""
    lines = torchtitan_options(Policy("offload"), version="0.3.0").splitlines()
    assert "--compile.cpu_offload_defer_n_layers 1" in lines
    assert any("its 0.3.0 pass refuses 0, so this asks for 1" in line for line in lines)
    deferred = Policy("offload", offload=OffloadOptions(defer_layers=2))
    lines = torchtitan_options(deferred, version="0.3.0").splitlines()
    assert "--compile.cpu_offload_defer_n_layers 2" in lines
    assert not any("refuses 0" in line for line in lines)


def test_graph_pass_export_carries_offload_tags_and_options() -> None:
    policy = Policy("offload", offload=OffloadOptions(budget_bytes=2**20))
    code = export(policy, "graph_pass")
    assert "OFFLOAD_OPTIONS = (1048576, 1, 0)" in code
    assert "offload=OffloadOptions(*OFFLOAD_OPTIONS)" in code
    assert "tags = decide_ops(facts, request)" in code
