#!/usr/bin/env bash
# The GPU checks of issues 33 and 36, as one script for a lent GPU machine (the device tool),
# whose torch may be older than the workbench's and unable to trace: the graphs are traced
# and packed here first (`scripts/pack_graphs.py` into out/gpu-pack/MODEL and
# `scripts/pack_rank_graph.py` into out/gpu-pack/ROW, carried along), and only run there.
# Run from the repository root with $OUT set, naming the groups to run (all by default):
#   graphs     `scripts/run_graphs.py` per model, then deterministically: MODEL.json
#   baselines  `scripts/run_baselines.py`: the eager baselines measured, in all.tar.xz
#   streams    `scripts/run_fsdp_streams.py`: one FSDP2 rank's reserved bytes beside the
#              allocator model's per-stream replay, fsdp-streams*.json
#   ranks      `scripts/run_rank_graph.py` per packed published row: ROW.json
# Each step is time-boxed and a failed one does not stop the next. Also writes log.txt and
# all.tar.xz[.NN] (snapshots, traces, figures).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/gpu-checks
rm -rf "$W" && mkdir -p "$W"
log=$OUT/log.txt
{
  date; nvidia-smi -L
  python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} >>"$log" 2>&1

step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "== $name $(date +%T): $*" >>"$log"
  timeout "$seconds" "$@" >>"$log" 2>&1
  echo "== $name rc=$? $(date +%T)" >>"$log"
}

graphs() {
  step debug 120 python3 scripts/run_graphs.py out/gpu-pack/debug "$W/debug" \
    --traces none,default,eager,full
  step 1b 300 python3 scripts/run_graphs.py out/gpu-pack/1b "$W/1b" --traces default
  (
    export CUBLAS_WORKSPACE_CONFIG=:4096:8  # what deterministic cuBLAS asks for
    step debug-det 60 python3 scripts/run_graphs.py out/gpu-pack/debug "$W/debug-det" \
      --deterministic
    step 1b-det 120 python3 scripts/run_graphs.py out/gpu-pack/1b "$W/1b-det" --deterministic
  )
  rm -f "$W"/*-det/*.snapshot.pickle
  for m in debug 1b debug-det 1b-det; do cp "$W/$m/result.json" "$OUT/$m.json" 2>>"$log"; done
}

baselines() {  # the eager baselines, measured
  for m in llama3-debug llama3-1b; do
    echo "== baselines $m $(date +%T)" >>"$log"
    timeout 180 python3 scripts/run_baselines.py "$m" bfloat16 >"$W/$m.baselines.json" 2>>"$log"
  done
}

streams() {  # FSDP2's streams' pools, measured (one process each)
  for exp in "" --expandable-segments; do
    echo "== fsdp-streams $exp $(date +%T)" >>"$log"
    timeout 180 python3 scripts/run_fsdp_streams.py llama3-1b --layers 4 --seq 2048 --batch 2 \
      $exp >"$OUT/fsdp-streams$exp.json" 2>>"$log"
  done
}

ranks() {  # each packed published row's rank graph, its collectives stood in for
  for pack in out/gpu-pack/pr*/; do
    row=$(basename "$pack")
    step "$row" 150 python3 scripts/run_rank_graph.py "$pack" "$OUT/$row.json" \
      --snapshot "$W/$row.snapshot.pickle"
  done
}

for group in "${@:-graphs baselines streams ranks}"; do
  for g in $group; do "$g"; done
done
ls -lR "$W" >>"$log"
tar cf - -C "$W" . | xz -T0 -6 >"$W.tar.xz"
if [ "$(stat -c %s "$W.tar.xz")" -gt 15000000 ]; then
  split -b 15000000 -d "$W.tar.xz" "$OUT/all.tar.xz."
else
  cp "$W.tar.xz" "$OUT/all.tar.xz"
fi
ls -l "$OUT" >>"$log"
