"""Run packed graphs (`scripts/pack_graphs.py`) on a CUDA GPU and record each step: its
generated code as is (only its CPU device constants moved to the GPU), timed, then run once
recording a memory snapshot (`max_memory_allocated` / `max_memory_reserved`) and once under
the profiler; every preset's loss and gradients checked bitwise against the graph with
nothing rematerialized and against the eager step. Needs torch and the workbench's model
files only, not its tracer, so it runs on a GPU whose torch is older than the workbench's.
Also records which SDPA kernel torch picks there for the model's attention, and the ops of
the step traced there with plain `make_fx` (`node_ops`), for the GPU-shaped graph.

    python scripts/run_graphs.py PACK_DIR OUT_DIR [--traces PRESET,...] [--device cpu]

(`--device cpu`: a dry run of everything but the GPU's recording, on any torch.)
"""

from __future__ import annotations

import argparse
import functools
import json
import linecache
import pickle
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile

from workbench.capture.models import load_workload
from workbench.capture.trace import functional_step


def node_ops(gm: torch.fx.GraphModule) -> Counter[tuple[str, str]]:
    """(op, output shapes) of every call node: what decides a graph's memory, comparable
    between a graph traced here and one traced on another machine or torch."""
    ops: Counter[tuple[str, str]] = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or "getitem" in str(node.target):
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        shapes = [list(v.shape) for v in vals if isinstance(v, torch.Tensor)]
        ops[(str(node.target).removeprefix("aten."), json.dumps(shapes))] += 1
    return ops


def _forward(code: str, name: str, device: str) -> Any:
    """The generated code's `forward`, compiled under an `<eval_with_key>` name as FX names
    its own, so a snapshot's frames point at lines of the very code the estimate read."""
    moved = code.replace("device(type='cpu')", "device(type='cuda', index=0)")
    source = moved if device == "cuda" else code
    filename = f"<eval_with_key>.{name}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {
        "torch": torch,
        "device": torch.device,
        "inf": float("inf"),
        "nan": float("nan"),
        "NoneType": type(None),
    }
    exec(compile(source, filename, "exec"), namespace)
    return namespace["forward"]


def _on_cpu(outputs: list[Any]) -> list[Any]:
    """Outputs kept for the bitwise checks, off the GPU whose peaks are being measured."""
    return [t.detach().cpu() for t in outputs]


def _differing(a: list[Any], b: list[Any]) -> int:
    """How many of the outputs differ, bit for bit."""
    return sum(not torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b, strict=True))


def _sdpa_choice(
    model: Any, dtype: torch.dtype, device: str, batch: int, seq: int
) -> dict[str, Any]:
    attention = next(m for n, m in model.named_modules() if n.endswith("attention"))
    heads = getattr(attention, "n_heads", None) or attention.num_heads
    kv = getattr(attention, "n_kv_heads", heads)
    dim = attention.head_dim
    q = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv, seq, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    if kv != heads:
        k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    gm = make_fx(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    )(q, k, v)
    return {
        "shape": [batch, heads, seq, dim],
        "ops": [str(n.target) for n in gm.graph.nodes if n.op == "call_function"],
    }


def _eager_step(meta: dict[str, Any], device: str) -> tuple[Any, list[Any], Any]:
    """The packed model built on `device`, the graph's inputs in its placeholder order, and
    the step the graph was traced from (`functional_step`), to run eagerly."""
    workload = load_workload(
        meta["model"], dtype=meta["dtype"], device=device, layers=meta["layers"]
    )
    step, args, kinds = functional_step(workload)
    assert [list(k) for k in kinds] == meta["inputs"], "the packed graph's inputs differ"
    return workload, args, step


def _record(once: Callable[[], list[Any]], cuda: bool, snapshot: Path) -> tuple[list[Any], dict]:
    """One run of the step, its memory recorded on a GPU: its outputs, max allocated and
    reserved (None on a CPU); the snapshot is written to `snapshot`."""
    peaks: dict[str, int | None] = {"max_memory_allocated": None, "max_memory_reserved": None}
    if not cuda:
        return once(), peaks
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(
        "all", context="all", stacks="python", max_entries=2_000_000
    )
    outputs = once()
    torch.cuda.synchronize()
    recorded = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    peaks = {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
    }
    with open(snapshot, "wb") as f:
        pickle.dump(recorded, f)
    return outputs, peaks


def _timed(once: Callable[[], list[Any]], sync: Callable[[], Any], warmup: int, repeats: int):
    """Step times in seconds, and the last timed run's outputs (on the CPU)."""
    for _ in range(warmup):
        once()
    sync()
    seconds, last = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        last = once()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds, _on_cpu(last)


def _trace(once: Callable[[], list[Any]], sync: Callable[[], Any], cuda: bool, path: Path) -> None:
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=True) as prof:
        once()
        sync()
    prof.export_chrome_trace(str(path))


def run(
    pack: Path, out: Path, traces: set[str], device: str, warmup: int = 1, repeats: int = 5
) -> dict[str, Any]:
    """Every packed preset run, timed, recorded and checked (see the module's docstring)."""
    meta = json.loads((pack / "meta.json").read_text())
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    workload, args, step = _eager_step(meta, device)
    eager = _on_cpu(step(*args))
    gpu_ops = node_ops(make_fx(step)(*args))
    result: dict[str, Any] = {
        "model": meta["model"],
        "device": torch.cuda.get_device_name() if cuda else device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "packed_with": meta["torch"],
        "pack": {k: meta[k] for k in ("model", "dtype", "kernels", "layers")},
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "sdpa": _sdpa_choice(
            workload.model, getattr(torch, meta["dtype"]), device, *workload.inputs[0].shape
        ),
        "traced_ops": [[op, s, n] for (op, s), n in sorted(gpu_ops.items())],
        "presets": {},
    }
    baseline = None
    for i, name in enumerate(meta["presets"]):
        forward = _forward((pack / f"{name}.py").read_text(), str(i), device)
        once = functools.partial(_no_grad_run, forward, args)
        if cuda:
            torch.cuda.empty_cache()
        seconds, previous = _timed(once, sync, warmup, repeats)
        outputs, peaks = _record(once, cuda, out / f"{name}.snapshot.pickle")
        outputs = _on_cpu(outputs)
        baseline = outputs if baseline is None else baseline
        median = sorted(seconds)[len(seconds) // 2]
        row = {
            **peaks,
            **meta["presets"][name],
            "step_seconds_median": median,
            "step_seconds": seconds,
            "tokens_per_second": workload.inputs[0].numel() / median,
            "outputs": len(outputs),
            "outputs_differing_from_its_last_run": _differing(outputs, previous),
            "outputs_differing_from_none": _differing(outputs, baseline),
            "outputs_differing_from_eager": _differing(outputs, eager),
            "loss": float(outputs[0]),
        }
        if name in traces:
            _trace(once, sync, cuda, out / f"{name}.trace.json")
        result["presets"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "step_seconds"}), flush=True)
    del baseline, eager
    _, result["eager_step"] = _record(lambda: step(*args), cuda, out / "eager_step.snapshot.pickle")
    return result


def _no_grad_run(forward: Any, args: list[Any]) -> list[Any]:
    with torch.no_grad():
        return list(forward(None, *args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("pack", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--traces", default="")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) for every run",
    )
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(a.deterministic)
    res = run(a.pack, a.out, set(a.traces.split(",")), a.device)
    (a.out / "result.json").write_text(json.dumps(res, indent=1))
