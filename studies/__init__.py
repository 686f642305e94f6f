"""Studies of other pass stacks, apart from the core flow (trace -> policy -> remat ->
estimate -> solve -> export): AOTAutograd's partitioners (`partition`, `mincut`) and eager
SAC under full-graph capture (`capture`). The notebooks use them; the workbench never does.

Not part of the installed package: it is imported from the repository's root, which `make
lab` (its Jupyter's `PYTHONPATH`) and the tests (pytest's `pythonpath`, the notebooks'
kernels) put on the path.
"""
