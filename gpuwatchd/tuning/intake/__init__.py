"""How work from jobs reaches the daemon: the spool and the control-socket workload ops.

Requests left in the spool directory (:mod:`.spool`) and the ``add_workloads`` /
``list_workloads`` / ``remove_workloads`` operations (:mod:`.workload_requests`). Their
payloads are :mod:`gpuwatchd.tuning.submitted`'s formats and whole ``[[workload]]``
tables, parsed with :mod:`gpuwatchd.tuning.workloads`, so this package sits above both;
nothing else in :mod:`gpuwatchd.tuning` imports it. The package imports nothing itself.
"""
