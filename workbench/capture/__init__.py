"""What one training step is: a workload (model, batch, loss), traced into one FX graph of
forward, loss and backward (`trace`), on one device or as one rank of a sharded job
(`parallel`), with the facts of every node (`graph.JointGraph`) and of every op (`ops`).

Modules: `workload`, `models` (the zoo: Llama3, DeepSeek-V3-style MoE, torchtitan's, user
factories), `tracing` and `trace`, `parallel` (FSDP x TP x EP on the fake process group; its
degrees in `degrees`, parameter shards in `param_shards`, the reference MoE's EP in
`expert_parallel`), `graph`, `ops` (embedded in exports), `fits` (what fits in memory now).
"""
