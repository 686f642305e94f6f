"""What to keep: the rules that tag every forward node save, recompute or offload, and the
`Policy` that asks them.

The rules (`EMBEDDED`, in this order) import only torch, the standard library and the files
before them: the `graph_pass` and `policy_fn` exports embed their source verbatim, so a
training job runs these very rules and `decide` cannot drift from what it exports. Records
are NamedTuples, not dataclasses, so the embedded code also runs where it is exec'd outside
`sys.modules`. Above them, `policy` (the policy file and its requests) and `decider` (the
rules' view of one traced graph, built once).
"""

# The files an export embeds, in order; each imports only the ones before it.
EMBEDDED = (
    "workbench.capture.ops",
    "workbench.decide.facts",
    "workbench.decide.tags",
    "workbench.decide.presets",
    "workbench.decide.tables",
    "workbench.decide.offloadable",
    "workbench.decide.engine",
)
