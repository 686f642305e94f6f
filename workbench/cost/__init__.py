"""What a policy costs: torch's remat pass replayed on arrays (`replay`), the exact what-if
estimate of memory and step time (`estimate`) on device profiles (`profiles`), and real
runs (`measure`; per-rank graphs on real gloo processes: `ranks`).
"""
