"""Graph passes: a tagged joint graph rematerialized by torch's own remat pass (`remat`),
then CPU offload of what the policy offloads (`offload`, placed by `placement`, on the
host ops of `host_ops`), and `index`, the index form every rewritten graph maps back to
(with the one definition of saved activation bytes), a rewritten graph being a node order
(`entries.NodeOrder`); `graph_trainer`, torchtitan graph trainer's own pass stack in its
order.
"""
