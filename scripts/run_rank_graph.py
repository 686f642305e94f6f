"""Run one rank's packed graph (`scripts/pack_rank_graph.py`) on one GPU and record what the
caching allocator reserved for it, beside what the workbench's allocator model estimated for
the same code. The rank's collectives cannot run on one GPU, so each is replaced by what it
does to memory: a functional all-gather, reduce-scatter or all-reduce allocates its output
on the calling stream and (NCCL's default, no `record_stream`) keeps its input alive until
its `wait_tensor`; their outputs are zeros (a finite loss; the values are of no concern).
Variants: the code as it runs (`freed`), its backward inputs held (`held`), with the AdamW
state allocated first (`held-adamw`: validate's setting), and `train`: torchtitan's step
after the graph too (gradients clipped, fused AdamW, its state made in the first step).
Needs torch only, not the workbench, so it runs on a GPU whose torch is older.

    python scripts/run_rank_graph.py PACK_DIR OUT.json [--device cpu] [--steps N]
        [--variants freed,held,held-adamw,train] [--snapshot FILE [--snapshot-variant NAME]]

(`--device cpu`: a dry run of the same code on a graph packed with `--kernels cpu`.)
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any


def _collectives(torch: Any) -> dict[str, Any]:
    """Stand-ins for `_c10d_functional`'s ops, by name, with the inputs they hold."""
    pending: dict[int, Any] = {}  # output's id -> the input the collective holds

    def all_gather_into_tensor(x: Any, group_size: int, group: str) -> Any:
        out = x.new_zeros((x.shape[0] * group_size, *x.shape[1:]))
        pending[id(out)] = x
        return out

    def reduce_scatter_tensor(x: Any, op: str, group_size: int, group: str) -> Any:
        out = x.new_zeros((x.shape[0] // group_size, *x.shape[1:]))
        pending[id(out)] = x
        return out

    def all_reduce(x: Any, op: str, group: str) -> Any:
        return x.clone(memory_format=torch.contiguous_format)

    def wait_tensor(x: Any) -> Any:
        pending.pop(id(x), None)
        return x

    return {
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_reduce": all_reduce,
        "wait_tensor": wait_tensor,
    }


def _forward(torch: Any, code: str, device: str, name: str) -> Any:
    """The packed code's `forward` with its collectives replaced and, on a GPU, its CPU
    device constants moved there; an op it calls that is not replaced is refused by name.
    Compiled under an `<eval_with_key>.N` name (N: the variant's number), as FX names its
    own, so that a snapshot's frames point at lines of the code (`workbench.cost.attribution`
    finds them by that name)."""
    stand_ins = _collectives(torch)
    ops = set(re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", code))
    unknown = ops - set(stand_ins)
    if unknown:
        raise SystemExit(f"collectives with no stand-in: {', '.join(sorted(unknown))}")
    code = re.sub(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", r"_c10d_\1(", code)
    if device == "cuda":
        code = code.replace("device(type='cpu')", "device(type='cuda', index=0)")
    namespace: dict[str, Any] = {
        "torch": torch,
        "device": torch.device,
        "inf": float("inf"),
        "nan": float("nan"),
        "NoneType": type(None),
        **{f"_c10d_{name}": fn for name, fn in stand_ins.items()},
    }
    filename = f"<eval_with_key>.{list(VARIANTS).index(name)}"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    exec(compile(code, filename, "exec"), namespace)
    return namespace["forward"]


def _args(torch: Any, meta: dict[str, Any], device: str) -> list[Any]:
    """The graph's inputs: floating ones small and random, integer ones (token ids, labels)
    zero, the device mesh None (the stand-ins take no group)."""
    args: list[Any] = []
    for spec in meta["inputs"]:
        if spec is None:
            args.append(None)
            continue
        dtype = getattr(torch, spec["dtype"])
        t = torch.empty_strided(spec["shape"], spec["stride"], dtype=dtype, device=device)
        if t.is_floating_point() or t.is_complex():
            t.normal_(0.0, 0.02)
        else:
            t.zero_()
        args.append(t)
    return args


# each variant: the code it runs, the optimizer's state allocated before the step, whether
# the optimizer steps after it (its state made lazily, as torch's AdamW makes it in the first
# step), and the packed estimate it is compared with
VARIANTS: dict[str, tuple[str, bool, bool, str]] = {
    "freed": ("freed", False, False, "freed"),
    "held": ("held", False, False, "held"),
    "held-adamw": ("held", True, False, "held-adamw"),
    "train": ("held", False, True, "held-adamw"),
}


def _peaks(torch: Any) -> dict[str, int]:
    torch.cuda.synchronize()
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": torch.cuda.memory_stats()["num_alloc_retries"],
    }


def _optimizer_step(torch: Any, params: list[Any], grads: list[Any], optimizer: Any) -> None:
    """torchtitan's step after the graph: the gradients on the parameters, clipped by their
    total norm (foreach), and fused AdamW."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    optimizer.step()


def _variant(torch: Any, meta: dict[str, Any], pack: Path, name: str, a: Any) -> dict[str, Any]:
    """One variant run `a.steps` times in a fresh allocator: what the estimate allocates
    first (cuBLAS's workspace, then the optimizer's state, then the inputs), then the steps;
    each step's peaks so far (and, training, after the graph and after the optimizer)."""
    cuda = a.device == "cuda"
    code, state_first, train, estimate = VARIANTS[name]
    forward = _forward(torch, (pack / f"{code}.py").read_text(), a.device, name)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        w = torch.ones(16, 16, device="cuda")
        (w @ w).sum().item()  # cuBLAS's workspace: the estimate holds it from the start
        del w
    state = []
    if state_first:
        for i in meta["param_inputs"]:
            shape = meta["inputs"][i]["shape"]
            state += [torch.zeros(shape, dtype=torch.float32, device=a.device) for _ in range(2)]
    args = _args(torch, meta, a.device)
    constants = torch.load(pack / "constants.pt")
    owner = argparse.Namespace(**{k: v.to(a.device) for k, v in constants.items()})
    params = [args[i] for i in meta["param_inputs"]]
    optimizer = torch.optim.AdamW(params, lr=1e-8, fused=True) if train else None
    row: dict[str, Any] = {**meta["variants"][estimate], "estimate_of": estimate, "steps": []}
    for step in range(a.steps):
        recording = cuda and a.snapshot is not None and step == 0 and name == a.snapshot_variant
        if recording:
            torch.cuda.memory._record_memory_history(
                "all", context="alloc", stacks="python", max_entries=1_000_000
            )
        start = time.perf_counter()
        for p in params:
            p.grad = None  # torchtitan's zero_grad, at the step's start
        with torch.no_grad():
            outputs = forward(owner, *args)
        entry: dict[str, Any] = {"loss": float(outputs[0])}
        grads = outputs[1 : 1 + len(params)]
        del outputs  # what the step held to its end (the backward's inputs) freed
        if train:
            entry["after_graph"] = _peaks(torch) if cuda else {}
            _optimizer_step(torch, params, grads, optimizer)
        del grads
        if recording:
            torch.cuda.synchronize()
            with open(a.snapshot, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            torch.cuda.memory._record_memory_history(None)
        entry["seconds"] = time.perf_counter() - start
        if cuda:
            entry.update(_peaks(torch))
        row["steps"].append(entry)
        print(name, step, json.dumps(entry), file=sys.stderr, flush=True)
    del state, args, owner, params, optimizer
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--snapshot", type=Path, help="a memory snapshot of one step, here")
    parser.add_argument("--snapshot-variant", default="held-adamw", help="of this variant")
    a = parser.parse_args()
    meta = json.loads((a.pack / "meta.json").read_text())
    # the allocator as packed, set before CUDA starts (as a job's environment sets it)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{meta['expandable_segments']}"
    import torch

    result: dict[str, Any] = {
        "row": meta["row"],
        "layers": meta["layers"],
        "seq": meta["seq"],
        "kernels": meta["kernels"],
        "packed_with": meta["torch"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
        "expandable_segments": meta["expandable_segments"],
        "published_gib": meta["published_gib"],
        "validate": meta["validate"],
        "variants": {},
    }
    for name in a.variants.split(","):
        result["variants"][name] = _variant(torch, meta, a.pack, name, a)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
