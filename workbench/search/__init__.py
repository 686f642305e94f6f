"""Searching policies: the solver for a memory budget and the Pareto front, and the random
policies of the soundness property (every accepted policy keeps eager's numbers).
"""
