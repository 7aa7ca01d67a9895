"""The CPU families: torch on the host's cores, for CI and hosts without a GPU."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = tuple(
    FamilySpec(f"cpu.{op}", ops, ("seed",), needs=("torch",), builder=f"{op}_family", device="cpu")
    for op, ops in (
        ("matmul", ("matmul", "gemm")),
        ("conv2d", ("conv2d", "conv")),
        ("bmm", ("bmm",)),
    )
)
