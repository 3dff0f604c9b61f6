"""Where an int8 / int4 decode kernel's time goes: the kernel with its steps switched off.

    python3 bench/cpu_kernel_parts.py [--threads 1] [--tokens 2048]

Each variant is the kernel of `cpu_attention.decode_int8` / `decode_int4` compiled with some of
its steps left out (scores, softmax, weight quantization, value sums); ns per (token, kv head)
with the KV in cache (one sequence, Llama-3-8B's head shape), so the differences between
variants are what each step costs. The outputs of the partial variants are meaningless. The
variants split the items as the kernels did before their work queue (Numba's static split, each
item allocating its scratch): compare them with each other, not with the kernels' own rates.
Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import prange  # noqa: E402

from cpu_attention import HostKVPool, KVDtype  # noqa: E402
from cpu_attention import decode as dm  # noqa: E402
from cpu_attention import decode_int4 as d4  # noqa: E402
from cpu_attention._numba import JIT  # noqa: E402
from cpu_attention import decode_int8 as d8  # noqa: E402
from cpu_attention._simd import IVEC, VEC  # noqa: E402
from cpu_attention.decode_items import NEG_INF, _keep_partial  # noqa: E402
from cpu_attention.decode_tiles import _softmax_tile, _tile_len, rest_heads  # noqa: E402
from cpu_attention.layout import INT4_GROUP  # noqa: E402

INT8_VARIANTS = {"full": (1, 1, 1), "no value sums": (1, 1, 0), "no scores": (0, 1, 1),
                 "softmax + weights only": (0, 1, 0), "loop and scales only": (0, 0, 0)}
INT4_VARIANTS = {"full": (1, 1, 1, 1, 1), "no value sums": (1, 1, 1, 1, 0), "no key dots": (1, 0, 1, 1, 1),
                 "no key factors, dots": (0, 0, 1, 1, 1), "no value factors, sums": (1, 1, 1, 0, 0),
                 "loop and scales only": (0, 0, 0, 0, 0)}


def int8_variant(SC, SM, AC):
    @numba.njit(parallel=True, **JIT)
    def kern(k, v, ks, vs, q, bt, items, tile, ahead, rest):
        R = len(rest)
        NI = items.shape[0]
        Hkv, D, BS = k.shape[1], 4 * k.shape[2], k.shape[3]
        G = q.shape[1] // Hkv
        TL = max(tile // BS, 1) * BS
        part_o = np.empty((NI, G, D), np.float32)
        part_m = np.empty((NI, G), np.float32)
        part_l = np.empty((NI, G), np.float32)
        for it in prange(NI):
            b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
            s, wp, wsc, vsc, qp, qc, qsc, kbase, ksbase, pf, gbase = d8._buffers(G, D, TL)
            s[:] = 0  # steps left out leave their outputs defined
            wp[:] = 0
            wsc[:] = 1
            m = np.full(G, NEG_INF, np.float32)
            l = np.zeros(G, np.float32)
            acc = np.zeros((G, D), np.float32)
            d8._split_q(q[b, h * G:(h + 1) * G], qp, qc, qsc)
            t = t0
            while t < t1:
                n = min(TL, t1 - t)
                nch, ngr = d8._tile_addresses(ks, vs, bt, b, h, t, n, t1, ahead, D, kbase, ksbase, pf, gbase, vsc)
                if SC:
                    d8._scores_heads(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, R)
                if SM:
                    d8._softmax_split(s, vsc, n, 4 * ngr, m, l, acc, wp, wsc)
                if AC:
                    d8._values_heads(wp, wsc, v, gbase, ngr, acc, R)
                t += n
            _keep_partial(it, acc, m, l, part_o, part_m, part_l)
        return part_o[0, 0, 0] + part_m[0, 0]
    return kern


def int4_variant(KF, DOT, SM, VF, AC):
    @numba.njit(parallel=True, **JIT)
    def kern(k, v, ks, kz, vs, vz, q, bt, items, rest):
        R = len(rest)
        NI = items.shape[0]
        NB, Hkv, BQ, Hb, _ = v.shape
        BS = vs.shape[2]
        D = 2 * Hb
        region = BS * Hb
        vregion = BQ * 4 * Hb
        NG = D // INT4_GROUP
        G = q.shape[1] // Hkv
        TL = min(_tile_len(BS), d4.SUM_TOKENS)
        TLV = -(-TL // VEC) * VEC  # (BS a multiple of 4 here: no padding columns)
        vflat = v.reshape(NB * Hkv * vregion)
        ks2, kz2 = ks.reshape(NB * Hkv, D), kz.reshape(NB * Hkv, D)
        vs2, vz2 = vs.reshape(NB * Hkv * BS, NG), vz.reshape(NB * Hkv * BS, NG)
        order = d4.pair_order(D)
        part_o = np.empty((NI, G, D), np.float32)
        part_m = np.empty((NI, G), np.float32)
        part_l = np.empty((NI, G), np.float32)
        for it in prange(NI):
            b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
            s = np.zeros((G, max(TL + IVEC, TLV)), np.float32)
            qn = np.empty((G, D), np.float32)
            for g in range(G):
                for d in range(D):
                    qn[g, d] = q[b, h * G + g, d]
            q16, qa = np.empty((G, D), np.int16), np.empty(G, np.float32)
            d4._query16(qn, order, q16, qa)
            u16, zs, bsc = np.empty(D, np.int16), np.empty(D, np.float32), np.empty(1, np.float32)
            qp = np.zeros((G, D), np.int16)
            qsc = np.ones(G, np.float32)
            qcon = np.zeros(G, np.float32)
            vsc = np.empty((NG, TLV), np.float32)
            vzr = np.empty((NG, TLV), np.float32)
            wq = np.zeros((d4.VALUE_PIECES, G, NG, TLV), np.uint8)
            wsc = np.ones((G, NG), np.float32)
            zsum = np.zeros((G, NG), np.float32)
            quads = np.empty(TL // 4 + 1, np.int64)
            m = np.full(G, NEG_INF, np.float32)
            l = np.zeros(G, np.float32)
            acc = np.zeros((G, D), np.float32)
            bi, off = t0 // BS, t0 % BS
            nbt = (t1 + BS - 1) // BS
            t = t0
            while t < t1:
                n = min(TL, t1 - t)
                u = 0
                while u < n:
                    blk = bt[b, bi]
                    nb = min(BS - off, n - u)
                    bh = blk * Hkv + h
                    r0 = bh * BS + off
                    nbi, noff = (bi + 1, 0) if off + nb == BS else (bi, off + nb)
                    pbh = bt[b, nbi] * Hkv + h if t + u + nb < t1 else bh
                    qbh = bt[b, bi + d4.PREFETCH_BLOCKS] * Hkv + h if bi + d4.PREFETCH_BLOCKS < nbt else bh
                    for j in range((nb + 3) // 4):
                        quads[u // 4 + j] = bh * vregion + (off // 4 + j) * 4 * Hb
                    if KF:
                        d4._key_factors(q16, qa, qn, ks2, kz2, bh, u16, zs, bsc, qp, qsc, qcon, R)
                    if DOT:
                        d4._scores_int4(qp, qsc, qcon, k, bh * region, BS, off, nb, v, qbh * region, qbh * vregion,
                                        pbh * vregion, s, u, R)
                    d4._scales_copy(vs2, vz2, r0, nb, vsc, vzr, u)
                    bi, off = nbi, noff
                    u += nb
                if SM:
                    _softmax_tile(s, n, m, l, acc)
                if VF:
                    d4._value_factors(s, vsc, vzr, n, wq, wsc, zsum)
                if AC:
                    d4._accumulate_quads_int4(wq, wsc, zsum, vflat, quads, (n + 3) // 4, acc, R)
                t += n
            _keep_partial(it, acc, m, l, part_o, part_m, part_l)
        return part_o[0, 0, 0] + part_m[0, 0]
    return kern


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtypes", default="int8,int4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", default="", help="only these variants, comma-separated (e.g. full)")
    args = ap.parse_args()
    n, Hkv, D, BS, G = args.tokens, 8, 128, 16, 4
    gen = torch.Generator().manual_seed(0)
    numba.set_num_threads(args.threads)
    lens = np.array([n], np.int64)
    items, _ = dm._plan(lens, Hkv, dm.chunk_tokens(lens, Hkv, BS, args.threads))
    bt = torch.randperm(n // BS, generator=gen).int()[None].numpy()
    q = (torch.randn(1, Hkv * G, D, generator=gen) * 0.088).numpy()
    print(f"{n} tokens in cache, {args.threads} thread(s), Hkv {Hkv}, G {G}, D {D}, block {BS}; "
          f"ns per (token, kv head) × threads")
    for dt in args.dtypes.split(","):
        pool = HostKVPool(1, n // BS, Hkv, BS, D, KVDtype(dt))
        for t in (pool.k, pool.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        a = pool.arrays
        for name in ("k_scale", "v_scale", "k_zero", "v_zero"):
            if name in a:
                a[name][...] = np.float32(0.02) if a[name].dtype == np.float32 else np.uint16(0x3CA4)  # 0.02 as bf16
        runs = []  # (name, kernel, its arguments)
        if dt == "int8":  # every variant at the engine's prefetch distance, then the whole kernel at others
            for name, flags in INT8_VARIANTS.items():
                runs.append((name, int8_variant(*flags), d8.PREFETCH_BLOCKS))
            runs += [(f"full, prefetch {p} blocks on", runs[0][1], p) for p in (1, 2, 8) if p != d8.PREFETCH_BLOCKS]
            runs = [(nm, f, (a["k"][0], a["v"][0], a["k_scale"][0], a["v_scale"][0], q, bt, items, d8.INT8_TILE, p,
                             rest_heads(G)))
                    for nm, f, p in runs]
        else:
            kargs = (a["k"][0], a["v"][0], a["k_scale"][0], a["k_zero"][0], a["v_scale"][0], a["v_zero"][0], q, bt,
                     items, rest_heads(G))
            runs = [(name, int4_variant(*flags), kargs) for name, flags in INT4_VARIANTS.items()]
        for name, f, kargs in runs:
            if args.variants and name not in args.variants.split(","):
                continue
            t0 = time.perf_counter()
            f(*kargs)
            tc = time.perf_counter() - t0
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                f(*kargs)
                ts.append(time.perf_counter() - t0)
            per = 1e9 * args.threads / (n * Hkv)
            print(f"{dt} {name:>28}: {min(ts) * per:6.1f} ns (median {np.median(ts) * per:6.1f}; compile {tc:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
