"""Work that jobs hand the daemon, as data: its formats and the checks on them.

A job's own Triton kernel (:mod:`.kernels`, with the launch keywords it may set,
:mod:`.launch_options`), the GEMM sites Inductor compiles (:mod:`.inductor_sites`), the
GEMMs and convolutions a model captures (:mod:`.captured`), the rule for which user code
the worker may import (:mod:`.trust`) and the read of a file someone else may have
written (:mod:`.regular_file`). Everything here is untrusted input, parsed strictly;
none of it is the tuning vocabulary the daemon's own configuration speaks.

It sits below :mod:`gpuwatchd.tuning.ops`: checking a workload of a job's op needs these
parsers. How such work arrives (the spool, the control-socket workload ops) parses whole
``[[workload]]`` tables with :mod:`gpuwatchd.tuning.workloads`, so it sits above that,
in :mod:`gpuwatchd.tuning.intake`. The package imports nothing itself: a job that sends
a kernel request loads only the modules it uses.
"""
