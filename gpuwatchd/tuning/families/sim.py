"""The simulated family: kernels whose time follows the simulated GPU's clock."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (
    FamilySpec(
        "sim", ("gemm", "matmul"), ("peak_tflops", "hbm_tbps"), builder="sim_family", device="sim"
    ),
)
