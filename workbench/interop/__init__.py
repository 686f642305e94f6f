"""The workbench beside other tools: a policy exported as code (`export`), parity with
torchtitan's graph trainer (`titan`), eager SAC as exported (`eager`) and the baselines it
is measured beside (`baselines`), the eager baselines as eager runs them under torch's memory
trackers (`eager_runs`, `trackers`), graph trainer's per-activation table (`activations`).
"""
