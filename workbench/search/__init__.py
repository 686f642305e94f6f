"""Searching policies: the solver for a memory budget (its linear model, the selection
methods) and the Pareto front, how low the peak goes at eager's step time (`floor`), and
the random policies of the soundness property (every accepted policy keeps eager's numbers).
"""
