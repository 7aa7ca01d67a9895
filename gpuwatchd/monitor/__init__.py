"""The live model of every GPU: the poller feeds a board of latest samples and gate decisions.

One GPU's gate over time (window, hysteresis, own PIDs) is a ``watch.GpuWatch``; the
poller holds one per GPU, and a job's client runs one over the daemon's samples.
"""
