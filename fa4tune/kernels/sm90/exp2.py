"""exp2 on the device: the MUFU instruction, and the software version on the FMA pipe whose exact
model is fa4tune.kernels.exp2_poly (the same instruction sequence, the same float32
coefficients)."""

from __future__ import annotations

import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import exp2_poly


def _hex_f32(value: float) -> str:
    """A float32 as a PTX immediate (0fXXXXXXXX), so the coefficient is exactly the modelled one."""
    return f"0f{struct.unpack('<I', struct.pack('<f', value))[0]:08X}"


def _emulated_exp2_ptx(degree: int) -> str:
    coeffs = exp2_poly.coefficients(degree)
    magic = _hex_f32(float(exp2_poly.ROUND_MAGIC))
    lines = [
        "{",
        ".reg .f32 xc, t, j, f, p;",
        ".reg .b32 tb, pb;",
        f"max.f32 xc, $1, {_hex_f32(float(exp2_poly.CLAMP_LOW))};",
        # Round toward -inf so that t's low mantissa bits hold floor(x); the two subtractions are
        # exact.
        f"add.rm.f32 t, xc, {magic};",
        f"sub.rn.f32 j, t, {magic};",
        "sub.rn.f32 f, xc, j;",
        f"mov.f32 p, {_hex_f32(coeffs[degree])};",
    ]
    # Horner with explicit fma.rn: no contraction choices left to ptxas, so the model is bit-exact.
    for k in range(degree - 1, -1, -1):
        lines.append(f"fma.rn.f32 p, p, f, {_hex_f32(coeffs[k])};")
    lines += [
        "mov.b32 tb, t;",
        "mov.b32 pb, p;",
        # floor(x) sits in tb's low bits (offset by the magic's mantissa, which the shift discards).
        "shl.b32 tb, tb, 23;",
        "add.s32 pb, pb, tb;",
        "mov.b32 $0, pb;",
        "}",
    ]
    return "\n".join(lines)


@dsl_user_op
def exp2_emulated(x: Float32, degree: int, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 127 by Cody-Waite split and a degree-`degree` polynomial, on FMA/ALU pipes."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _emulated_exp2_ptx(degree),
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def exp2_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the MUFU (ex2.approx, flush-to-zero): one SFU op per element."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "ex2.approx.ftz.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def emulated_columns(num_columns: int, emu_share: float) -> tuple[bool, ...]:
    """Which of a thread's score columns take the software exp2: `emu_share` of them, spread evenly
    (Bresenham) so that MUFU and FMA work interleave in the instruction stream."""
    picks = []
    for c in range(num_columns):
        picks.append(int((c + 1) * emu_share) > int(c * emu_share))
    return tuple(picks)
