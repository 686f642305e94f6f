"""Studies of other pass stacks, apart from the core pipeline (trace -> policy -> remat ->
estimate -> solve -> export): AOTAutograd's partitioners (`partition`, `mincut`) and eager
SAC under full-graph capture (`capture`). The notebooks use them; the core never does.
"""
