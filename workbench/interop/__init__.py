"""The workbench beside other tools: a policy exported as code (`export`), parity with
torchtitan's graph trainer (`titan`), eager SAC as exported (`eager`) and the baselines it
is measured beside (`baselines`), the eager baselines as eager runs them under torch's memory
trackers (`eager_runs`, `trackers`), graph trainer's per-activation table (`activations`),
published runs beside their estimates (`published`, `validate`) and a step as torchtitan's
compiler toolkit ran it, measured (`toolkit`).
"""
