"""The entry points of the Python exports, written as modules that ruff and mypy check like any
other: `eager_sac` (the `policy_fn` export: `policy_fn`, `apply_ac`) and `graph_pass` (the
`graph_pass` export: `tag_graph`).

`workbench.interop.export` writes a template's docstring, then the policy's constants (the
names `constants` stands in for here), the rules (`workbench.decide.EMBEDDED`), and the
template's code after its imports, verbatim. Its imports of torch and the standard library
join the file's; its imports of workbench modules are dropped, since the generated file
defines those names itself.
"""
