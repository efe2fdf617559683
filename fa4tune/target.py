"""Target descriptions: the limits and throughputs of a GPU, read by the feasibility checks, the
kernels and the cost model. The one place where hardware numbers live."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


class TargetError(ValueError):
    """An unknown target name."""


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # the CuTe DSL / ptxas target, e.g. "sm_90a"
    sm_count: int
    clock_mhz: float  # sustained SM clock under tensor load
    smem_per_block: int  # bytes of shared memory one block may opt into
    smem_per_sm: int
    regs_per_sm: int  # 32-bit registers
    max_regs_per_thread: int
    max_threads_per_block: int
    # Throughputs per SM per clock.
    tensor_flops_per_clk: int  # dense bf16/fp16 MMA, FLOP (multiply and add count 2)
    mufu_ex2_per_clk: int  # ex2.approx results
    fma_per_clk: int  # fp32 FMA lanes
    alu_issue_per_clk: int  # warp-instructions issued per clock by all schedulers, times 32 lanes
    smem_bytes_per_clk: int
    # Per device.
    hbm_bytes_per_s: float
    l2_bytes: int
    # Measured matrix rate (dense bf16, large GEMM) where we have it; None falls back to the peak.
    measured_tensor_tflops: float | None = None

    @property
    def peak_tensor_tflops(self) -> float:
        return self.tensor_flops_per_clk * self.sm_count * self.clock_mhz * 1e6 / 1e12

    def to_dict(self) -> dict:
        return asdict(self)


_HOPPER = dict(
    arch="sm_90a",
    smem_per_block=227 * 1024,
    smem_per_sm=228 * 1024,
    regs_per_sm=64 * 1024,
    max_regs_per_thread=255,
    max_threads_per_block=1024,
    tensor_flops_per_clk=4096,
    mufu_ex2_per_clk=16,
    fma_per_clk=128,
    alu_issue_per_clk=128,
    smem_bytes_per_clk=128,
)

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            name="H100-SXM",
            sm_count=132,
            clock_mhz=1830,
            hbm_bytes_per_s=3.35e12,
            l2_bytes=50 * 2**20,
            **_HOPPER,
        ),
        # H100 PCIe: 114 SMs, a lower boost clock and HBM2e (NVIDIA's H100 datasheet).
        Target(
            name="H100-PCIe",
            sm_count=114,
            clock_mhz=1755,
            hbm_bytes_per_s=2.0e12,
            l2_bytes=50 * 2**20,
            **_HOPPER,
        ),
        # H200: the H100's SM at the same clocks with faster HBM3e. The matrix rate is the one
        # measured on our H200 (bf16 8192^3 GEMM, the design notes), the copy rate 4.3 TB/s as
        # measured there.
        Target(
            name="H200",
            sm_count=132,
            clock_mhz=1830,
            hbm_bytes_per_s=4.3e12,
            l2_bytes=60 * 2**20,
            measured_tensor_tflops=750.0,
            **_HOPPER,
        ),
        Target(
            name="B200",
            arch="sm_100a",
            sm_count=148,
            clock_mhz=1850,
            smem_per_block=227 * 1024,
            smem_per_sm=228 * 1024,
            regs_per_sm=64 * 1024,
            max_regs_per_thread=255,
            max_threads_per_block=1024,
            tensor_flops_per_clk=8192,
            mufu_ex2_per_clk=16,
            fma_per_clk=128,
            alu_issue_per_clk=128,
            smem_bytes_per_clk=128,
            hbm_bytes_per_s=8.0e12,
            l2_bytes=126 * 2**20,
        ),
    )
}

DEFAULT_TARGET = "H200"


def get_target(name: str | Target | None = None) -> Target:
    """A target by name (case-insensitive); None means the local GPU if one is known, else H200."""
    if isinstance(name, Target):
        return name
    if name is None:
        return detect_target() or TARGETS[DEFAULT_TARGET]
    for key, target in TARGETS.items():
        if key.lower() == str(name).lower():
            return target
    raise TargetError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")


def target_for_device_name(device_name: str, sm_count: int | None = None) -> Target | None:
    """Map a CUDA device name such as 'NVIDIA H200' or 'NVIDIA H100 80GB HBM3' to a target. With the
    device's SM count (`multi_processor_count`), a device with other SMs than its model's (a MIG
    slice, a cut-down part) gets the target with its own count: persistent kernels size their grid
    by it."""
    upper = device_name.upper()
    for token, key in (
        ("H200", "H200"),
        ("H100 PCIE", "H100-PCIe"),
        ("H100", "H100-SXM"),
        ("H800 PCIE", "H100-PCIe"),
        ("H800", "H100-SXM"),
        ("B200", "B200"),
    ):
        if token in upper:
            target = TARGETS[key]
            if sm_count is not None and sm_count != target.sm_count:
                target = replace(target, sm_count=int(sm_count))
            return target
    return None


def undescribed_hopper(device_name: str, sm_count: int, l2_bytes: int | None = None) -> Target:
    """A Hopper GPU (sm_90) that TARGETS does not describe (an H20, say): the SM every sm_90 part
    shares (shared memory, registers, the sm_90a instructions), with the device's own SM count and
    L2 size; the clock and throughputs, which only the cost model reads, are the H100 SXM's. It
    carries the device's name, which no tuned table names, so lookups give the kernel's default
    configs."""
    base = TARGETS["H100-SXM"]
    return replace(
        base, name=device_name, sm_count=int(sm_count), l2_bytes=int(l2_bytes or base.l2_bytes)
    )


def partial_gpu(target: Target, gpu_name: str) -> str | None:
    """Why a search must not run on this GPU, when it has other SMs than its model (a MIG slice):
    its timings would be stored and exported under the model's name. None for a whole GPU."""
    whole = TARGETS[target.name].sm_count
    if target.sm_count == whole:
        return None
    return (
        f"{gpu_name} has {target.sm_count} SMs, not the {whole} of an {target.name} (a MIG "
        "slice?): a search would store its timings as the whole GPU's. Search on a whole GPU."
    )


def target_for_device(props) -> Target | None:
    """The target of a CUDA device from its properties (torch's): its model's, with its own SM
    count; for a Hopper GPU that no target describes, undescribed_hopper; None for any other GPU."""
    target = target_for_device_name(props.name, props.multi_processor_count)
    if target is None and (props.major, props.minor) == (9, 0):
        target = undescribed_hopper(
            props.name, props.multi_processor_count, getattr(props, "L2_cache_size", None)
        )
    return target


def is_described(target: Target) -> bool:
    """Whether the target is one of TARGETS (a MIG slice's included), not an undescribed_hopper."""
    return target.name in TARGETS


def detect_target(undescribed: bool = False) -> Target | None:
    """The target of the current CUDA device, or None without a GPU that TARGETS describes; with
    `undescribed`, a Hopper GPU it does not describe gets undescribed_hopper (what fa4tune.attention
    and lookups run it with; searches and the cost model need a described GPU). Never raises."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        target = target_for_device(torch.cuda.get_device_properties(torch.cuda.current_device()))
        return target if target is not None and (undescribed or is_described(target)) else None
    except Exception:
        return None
