"""User-style Triton kernels decorated with ``gpuwatchd.triton.autotune``.

Written for gpuwatchd's user-kernel tuning: a fused matmul + bias +
activation, a row softmax and a layer norm, each with a real config list. Importable as
``user_kernels`` with ``PYTHONPATH=examples`` (the tuning worker imports them by name,
so list ``user_kernels`` in ``[tuning] allowed_modules``). ``faulty`` holds a kernel
with a deliberate bug in some configs, to show the worker's output check.
"""
