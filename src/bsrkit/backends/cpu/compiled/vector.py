# mypy: disable-error-code="call-arg,var-annotated"
# (mypy reads intrinsics as taking their typing context too, and cannot type what they return.)
"""A SIMD vector type for the compiled loops, and its intrinsics.

numba has no SIMD type, so :class:`Vec` is one: an LLVM vector of 32 bytes (8 float32 or 4 float64; on
narrower or wider hardware LLVM splits or packs it), held in registers like any scalar local. The vector loops
(:mod:`.small`) use only these intrinsics (load, load of two interleaved columns, splat, add, multiply-add,
lane, horizontal sum, store), so the order of every sum is the one written: no fast-math flags (NaN and inf
behave as in IEEE arithmetic).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic, models, register_model

from bsrkit.backends.cpu.compiled.intrinsics import I32


class Vec(types.Type):
    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.lanes = 32 // (dtype.bitwidth // 8)
        super().__init__(name=f"vec{self.lanes}x{dtype}")


@register_model(Vec)
class VecModel(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        scalar = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(scalar, fe_type.lanes))


def float_pointer(t: Any) -> Any:
    if not (isinstance(t, types.CPointer) and isinstance(t.dtype, types.Float)):
        raise errors.TypingError(f"vector op: expected a float pointer, got {t}")
    return t.dtype


@intrinsic
def vload(typingctx, p, offset):
    """The vector of elements ``p[offset], p[offset + 1], ...`` (no alignment assumed)."""
    vec = Vec(float_pointer(p))

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        vty = context.get_value_type(signature.return_type)
        loaded = builder.load(builder.bitcast(where, vty.as_pointer()), align=vec.dtype.bitwidth // 8)
        return loaded

    return vec(p, offset), codegen


@intrinsic
def vload_pairs(typingctx, p, offset):
    """Two vectors from the ``2 * lanes`` elements at ``p[offset]``: the even-indexed and the odd-indexed ones
    (the two columns of a row-major ``(k, 2)`` matrix: one load, then two shuffles)."""
    vec = Vec(float_pointer(p))

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        wide = ir.VectorType(context.get_value_type(vec.dtype), 2 * vec.lanes)
        loaded = builder.load(builder.bitcast(where, wide.as_pointer()), align=vec.dtype.bitwidth // 8)
        lane_indices = ir.VectorType(I32, vec.lanes)
        halves = [
            builder.shuffle_vector(
                loaded,
                ir.Constant(wide, ir.Undefined),
                ir.Constant(lane_indices, list(range(phase, 2 * vec.lanes, 2))),
            )
            for phase in (0, 1)
        ]
        return context.make_tuple(builder, signature.return_type, halves)

    return types.UniTuple(vec, 2)(p, offset), codegen


@intrinsic
def vsplat(typingctx, x):
    """The vector with ``x`` in every lane."""
    if not isinstance(x, types.Float):
        raise errors.TypingError(f"vsplat: expected a float, got {x}")
    vec = Vec(x)

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        one = builder.insert_element(ir.Constant(vty, ir.Undefined), llargs[0], I32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, vec.lanes), [0] * vec.lanes))

    return vec(x), codegen


@intrinsic
def vzero(typingctx, zero):
    """The vector of zeros of ``zero``'s float type."""
    if not isinstance(zero, types.Float):
        raise errors.TypingError(f"vzero: expected a float, got {zero}")
    vec = Vec(zero)

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        return ir.Constant(vty, [ir.Constant(vty.element, 0.0)] * vec.lanes)

    return vec(zero), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` lane by lane (``llvm.fmuladd``: one fused instruction where the CPU has one)."""
    if not (isinstance(a, Vec) and a == b == c):
        raise errors.TypingError(f"vfma: expected three vectors of one type, got {a}, {b}, {c}")

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        suffix = f"v{vty.count}f{a.dtype.bitwidth}"
        fn = builder.module.declare_intrinsic(f"llvm.fmuladd.{suffix}", fnty=ir.FunctionType(vty, [vty] * 3))
        return builder.call(fn, llargs)

    return a(a, b, c), codegen


@intrinsic
def vlane(typingctx, v, j):
    """Lane ``j`` of ``v``."""
    if not isinstance(v, Vec):
        raise errors.TypingError(f"vlane: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        return builder.extract_element(
            llargs[0], context.cast(builder, llargs[1], signature.args[1], types.int32)
        )

    return v.dtype(v, j), codegen


@intrinsic
def vsum(typingctx, v):
    """The sum of ``v``'s lanes, in lane order."""
    if not isinstance(v, Vec):
        raise errors.TypingError(f"vsum: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        s = builder.extract_element(llargs[0], I32(0))
        for j in range(1, v.lanes):
            s = builder.fadd(s, builder.extract_element(llargs[0], I32(j)))
        return s

    return v.dtype(v), codegen


@intrinsic
def vstore(typingctx, p, offset, v):
    """``p[offset], p[offset + 1], ... = v`` (no alignment assumed)."""
    if not (isinstance(v, Vec) and float_pointer(p) == v.dtype):
        raise errors.TypingError(f"vstore: expected a vector of {p}'s type, got {v}")

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        builder.store(
            llargs[2], builder.bitcast(where, llargs[2].type.as_pointer()), align=v.dtype.bitwidth // 8
        )
        return context.get_dummy_value()

    return types.void(p, offset, v), codegen


@intrinsic
def vwidth(typingctx, v):
    """The number of lanes of ``v`` (a constant)."""
    if not isinstance(v, Vec):
        raise errors.TypingError(f"vwidth: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        return context.get_constant(types.intp, v.lanes)

    return types.intp(v), codegen


@intrinsic
def vmul(typingctx, a, b):
    """``a * b`` lane by lane."""
    if not (isinstance(a, Vec) and a == b):
        raise errors.TypingError(f"vmul: expected two vectors of one type, got {a}, {b}")

    def codegen(context, builder, signature, llargs):
        return builder.fmul(*llargs)

    return a(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    """``a + b`` lane by lane."""
    if not (isinstance(a, Vec) and a == b):
        raise errors.TypingError(f"vadd: expected two vectors of one type, got {a}, {b}")

    def codegen(context, builder, signature, llargs):
        return builder.fadd(*llargs)

    return a(a, b), codegen


@intrinsic
def prefetch(typingctx, p, offset):
    """A hint to bring the cache line of ``p[offset]`` into the caches (``llvm.prefetch``: read, high
    locality); never faults, so ``offset`` may point past the data."""
    float_pointer(p)
    fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), I32, I32, I32])

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(where, fnty.args[0]), I32(0), I32(3), I32(1)])
        return context.get_dummy_value()

    return types.void(p, offset), codegen
