"""The CPU families: torch on the host's cores, for CI and hosts without a GPU."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (
    FamilySpec(
        "cpu.matmul", ("matmul", "gemm"), ("seed",), needs=("torch",), builder="matmul_family"
    ),
    FamilySpec(
        "cpu.conv2d", ("conv2d", "conv"), ("seed",), needs=("torch",), builder="conv2d_family"
    ),
    FamilySpec("cpu.bmm", ("bmm",), ("seed",), needs=("torch",), builder="bmm_family"),
)
