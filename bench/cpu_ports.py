"""Vector throughput of this host's cores: which instructions the decode kernels can afford.

    python3 bench/cpu_ports.py [--threads 1,2,4,8,16]

Each probe is a loop of 12 independent accumulator chains of one instruction (AVX-512 VNNI
vpdpbusd / vpdpwssd, vpmaddwd + add, float FMA at 512 and 256 bits; vpmovsxbw and a two-source
word shuffle each followed by an add, which keeps LLVM from folding the chain), compiled by llvmlite for this CPU, run on 1..N threads at once (ctypes calls
release the GIL). Instructions per ns per thread at one thread tell how many ports execute an
instruction (× the clock); the total at N threads against N × one thread tells whether the
vCPUs are cores of their own or hyperthread pairs sharing ports. Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

import llvmlite.binding as llvm
from llvmlite import ir

CHAINS = 12
UNROLL = 4  # instructions of each chain per loop iteration


def _probe(name: str, lanes_ty, step):
    """A function i64 run(i64 n): n iterations of UNROLL × CHAINS `step(builder, acc, x, y)` calls."""
    mod = ir.Module(name=name)
    i64 = ir.IntType(64)
    fn = ir.Function(mod, ir.FunctionType(i64, [i64]), name="run")
    entry, loop, done = fn.append_basic_block("entry"), fn.append_basic_block("loop"), fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    n = fn.args[0]
    seed = b.trunc(n, ir.IntType(32))
    ivec = ir.VectorType(ir.IntType(32), lanes_ty.count)  # 32-bit lanes only
    sv = b.insert_element(ir.Constant(ivec, None), seed, ir.IntType(32)(0))
    # float lanes as converted integers, not their bits: small integers' bits are denormal floats,
    # which Intel cores run through microcode (the first GPU-host run read fma at 0.02 a ns)
    cast = (lambda v: b.sitofp(v, lanes_ty)) if isinstance(lanes_ty.element, ir.FloatType) else \
        (lambda v: b.bitcast(v, lanes_ty))
    x = cast(b.add(sv, ir.Constant(ivec, [3] * ivec.count)))
    y = cast(b.add(sv, ir.Constant(ivec, [5] * ivec.count)))
    inits = [cast(b.add(sv, ir.Constant(ivec, [k] * ivec.count))) for k in range(CHAINS)]
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    accs = [b.phi(lanes_ty) for _ in range(CHAINS)]
    cur = list(accs)
    for _ in range(UNROLL):
        cur = [step(b, mod, a, x, y) for a in cur]
    i2 = b.add(i, i64(1))
    i.add_incoming(i64(0), entry)
    i.add_incoming(i2, loop)
    for a, c, k0 in zip(accs, cur, inits):
        a.add_incoming(k0, entry)
        a.add_incoming(c, loop)
    b.cbranch(b.icmp_signed("<", i2, n), loop, done)
    b.position_at_end(done)
    tot = ir.Constant(ivec, None)
    for c in cur:
        tot = b.xor(tot, b.bitcast(c, ivec))
    b.ret(b.zext(b.extract_element(tot, ir.IntType(32)(0)), i64))
    return mod


def _intrin(name, ty, nargs):
    def step(b, mod, a, x, y):
        f = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ty, [ty] * nargs), name=name)
        return b.call(f, [a, x, y][:nargs])
    return step


def _fma(lanes):
    ty = ir.VectorType(ir.FloatType(), lanes)
    return ty, _intrin(f"llvm.fma.v{lanes}f32", ty, 3)


def _sext_add(b, mod, a, x, y):  # vpmovsxbw (+ a cheap add to chain it)
    i8v, i16v = ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(16), 32)
    v8 = b.bitcast(b.xor(a, x), i8v)
    lo = b.shuffle_vector(v8, v8, ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32))))
    return b.add(b.bitcast(b.sext(lo, i16v), a.type), y)


def _permw(b, mod, a, x, y):  # a two-source word shuffle (vpunpcklwd), then an add so chains do not fold
    i16v = ir.VectorType(ir.IntType(16), 32)
    mask = [x2 for k in range(4) for i in range(4) for x2 in (8 * k + i, 32 + 8 * k + i)]
    sh = b.shuffle_vector(b.bitcast(a, i16v), b.bitcast(x, i16v), ir.Constant(ir.VectorType(ir.IntType(32), 32), mask))
    return b.add(b.bitcast(sh, a.type), y)


def _madd_add(b, mod, a, x, y):  # vpmaddwd then vpaddd: what LLVM emits without VNNI
    i16v, i32v = ir.VectorType(ir.IntType(16), 32), a.type
    name = "llvm.x86.avx512.pmaddw.d.512"
    f = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(i32v, [i16v, i16v]), name=name)
    return b.add(b.call(f, [b.bitcast(b.xor(a, x), i16v), b.bitcast(y, i16v)]), x)


def probes():
    i32x16 = ir.VectorType(ir.IntType(32), 16)
    out = {
        "vpdpbusd zmm": (i32x16, _intrin("llvm.x86.avx512.vpdpbusd.512", i32x16, 3)),
        "vpdpwssd zmm": (i32x16, _intrin("llvm.x86.avx512.vpdpwssd.512", i32x16, 3)),
        "vpmaddwd+add zmm": (i32x16, _madd_add),
        "fma zmm": _fma(16),
        "fma ymm": _fma(8),
        "vpmovsxbw zmm": (i32x16, _sext_add),
        "word shuffle zmm": (i32x16, _permw),
    }
    ymm = ir.VectorType(ir.IntType(32), 8)
    out["vpdpbusd ymm"] = (ymm, _intrin("llvm.x86.avx512.vpdpbusd.256", ymm, 3))
    return out


def compile_all():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
                                      opt=2)
    engines, fns = [], {}
    for name, (ty, step) in probes().items():
        try:
            mod = llvm.parse_assembly(str(_probe(name.replace(" ", "_"), ty, step)))
            mod.verify()
            ee = llvm.create_mcjit_compiler(mod, tm)
            ee.finalize_object()
        except Exception as e:  # an instruction this CPU lacks
            print(f"{name}: not compiled ({type(e).__name__}: {str(e)[:80]})")
            continue
        engines.append(ee)
        fns[name] = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(ee.get_function_address("run"))
    return engines, fns


def rate(fn, threads: int, iters: int) -> float:
    """Instructions per ns per thread, with `threads` threads running fn at once."""
    times = [0.0] * threads
    barrier = threading.Barrier(threads)

    def work(k):
        barrier.wait()
        t0 = time.perf_counter()
        fn(iters)
        times[k] = time.perf_counter() - t0

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return iters * UNROLL * CHAINS / max(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=2_000_000)
    args = ap.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    llvm_flags = llvm.get_host_cpu_features()
    print(f"host cpu {llvm.get_host_cpu_name()}, avx512vnni {llvm_flags.get('avx512vnni', False)}, "
          f"amx-int8 {llvm_flags.get('amx-int8', False)}")
    engines, fns = compile_all()
    print(f"{'instruction':>18} " + " ".join(f"{'T=' + str(t):>14}" for t in counts) + "   (per thread / all threads, per ns)")
    for name, fn in fns.items():
        fn(1000)
        cells = []
        for t in counts:
            r = max(rate(fn, t, args.iters) for _ in range(2))
            cells.append(f"{r:6.2f}/{r * t:6.1f}")
        print(f"{name:>18} " + " ".join(f"{c:>14}" for c in cells), flush=True)
    sys.stdout.flush()
    os._exit(0)  # MCJIT engines torn down at exit can crash: leave them to the OS


if __name__ == "__main__":
    main()
