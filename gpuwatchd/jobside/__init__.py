"""Job-side implementation of :mod:`gpuwatchd.triton` (and of the capture and Inductor hooks).

These modules run in the user's job process and may import torch and Triton; the
daemon never imports them. Public entry points live in :mod:`gpuwatchd.triton` and
:mod:`gpuwatchd.torch`.
"""
