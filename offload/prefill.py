"""Prefill of the heterogeneous runner (`offload.runner.Runner`, which mixes this class in):
layer by layer over the whole new chunk of a sequence, this layer's earlier KV (both tiers)
gathered to the device once, the new tokens attending to it and causally to themselves in one
SDPA call, the new k/v written to their tiers.

A piece's keys and values, the earlier ones and its own, go into one buffer pair [Hkv, P + T, D]
made once a piece and filled again each layer: the earlier KV is never held twice (gathered,
then joined to the new by a copy), which at 128k of earlier tokens was ~0.5 GB more a layer.

The methods use the runner's model, cache, device and its streamed-weight hooks (`_begin_pass`,
`ready_weights`, `release_weights`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from offload.worker import MAIN
from planner.workspace import PREFILL_PIECE

PREFILL_CHUNK = 2048  # tokens per projection/MLP pass and per attention query block in prefill
PRIOR_PIECE = 4096  # tokens of the device tier gathered at once for a prefill's prior KV


class Prefill:
    """`prefill` for `Runner` (module doc)."""

    @torch.inference_mode()
    def prefill(self, seq: int, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens[start:] (tokens[:start] are cached) → float32 logits of the last token [1, V] (or all).

        Pieces of PREFILL_PIECE tokens bound the activations a long prompt needs on the device;
        each piece runs layer by layer and attends to everything cached before it."""
        self.worker.kernels_on(MAIN)
        outs = [self._prefill_piece(seq, tokens[: s + PREFILL_PIECE], s, all_logits)
                for s in range(start, len(tokens), PREFILL_PIECE)]
        return torch.cat(outs) if all_logits else outs[-1]

    def _prefill_piece(self, seq: int, tokens: list[int], start: int, all_logits: bool) -> torch.Tensor:
        c, m, dev = self.cache, self.model, self.dev
        T = len(tokens) - start
        prior = c.seqs.get(seq)
        prior_gpu = 0 if prior is None else prior.gpu.num_tokens
        prior_host = 0 if prior is None else prior.host.num_tokens
        c.seal_complete()
        slots = c.reserve(seq, T)
        s = c.seqs[seq]
        gpu_blocks = torch.tensor(s.gpu.blocks[: -(-prior_gpu // c.block_size)], dtype=torch.int64,
                                  device=c.gpu.k.device if prior_gpu else "cpu")  # up once, not once a layer
        host_blocks = torch.tensor(s.host.blocks[: -(-prior_host // c.block_size)], dtype=torch.int64)
        pos = torch.arange(start, len(tokens), device=dev)
        x = m.embed(torch.tensor(tokens[start:]))
        bufs = None  # the piece's keys and values [Hkv, P + T, D], where it has earlier tokens
        self._begin_pass()
        with m.rope.positions_below(len(tokens)):  # no read-back a layer
            for i in range(self.cfg.num_layers):
                self.ready_weights(i)
                q, k, v = self._chunked(lambda a, b: m.pre_attention(i, x[a:b], pos[a:b]), T)
                if prior_gpu + prior_host:
                    if bufs is None:
                        shape = (self.cfg.num_kv_heads, prior_gpu + prior_host + T, self.cfg.head_dim)
                        bufs = tuple(torch.empty(shape, device=dev, dtype=q.dtype) for _ in range(2))
                    self._prior_kv(i, gpu_blocks, prior_gpu, host_blocks, prior_host, bufs)
                    for buf, t in zip(bufs, (k, v)):
                        buf[:, prior_gpu + prior_host:].copy_(t.transpose(0, 1))
                    keys, vals = bufs
                else:
                    keys, vals = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
                c.write(i, slots, k, v)
                o = self._chunked(lambda a, b: _causal_tail_attention(q[a:b], keys[:, : keys.shape[1] - T + b],
                                                                      vals[:, : keys.shape[1] - T + b], m.scale), T)
                x = self._chunked(lambda a, b: m.post_attention(i, x[a:b], o[a:b]), T)
                self.release_weights(i)
        self.ready_weights(self.cfg.num_layers)
        logits = m.logits(x if all_logits else x[-1:])
        self.release_weights(self.cfg.num_layers)
        return logits

    def _prior_kv(self, i, gpu_blocks, n_gpu, host_blocks, n_host, bufs) -> None:
        """This layer's cached K, V of the sequence from both tiers into bufs[0], bufs[1] [Hkv, ≥ P, D]
        on the device, tokens [0, P), a piece of PRIOR_PIECE tokens at a time (the float32
        temporaries of one piece): the device tier's, then the host tier's, whose blocks go up as
        stored and are dequantized on the device (the CPU's torch dequantization took 13.8 µs a
        token of int4 on the 2-core machine, and a 128k prompt reads ~31M token-layers back)."""
        c, BS = self.cache, self.cache.block_size
        per = PRIOR_PIECE // BS
        for j in range(0, -(-n_gpu // BS), per):
            kv = c.gpu.gather(i, gpu_blocks[None, j:j + per])
            n = min(n_gpu - j * BS, kv[0].shape[2])
            for buf, t in zip(bufs, kv):
                buf[:, j * BS:j * BS + n].copy_(t[0, :, :n])
        for j in range(0, len(host_blocks), per):
            n = min(n_host - j * BS, per * BS)
            for buf, t in zip(bufs, c.host.gather(i, host_blocks[j:j + per], n, device=self.dev)):
                buf[:, n_gpu + j * BS:n_gpu + j * BS + n].copy_(t)

    @staticmethod
    def _chunked(fn, T: int):
        """fn over the chunks of T rows, joined (one chunk: fn's own result, no copy)."""
        if T <= PREFILL_CHUNK:
            return fn(0, T)
        outs = [fn(a, b) for a, b in _blocks(T)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(z) for z in zip(*outs))
        return torch.cat(outs)


def _blocks(T: int) -> list[tuple[int, int]]:
    return [(a, min(a + PREFILL_CHUNK, T)) for a in range(0, T, PREFILL_CHUNK)]


def _causal_tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] are the last T of the keys' positions: key j is visible to query t iff
    j ≤ (n_keys − T) + t (earlier tokens all, new ones causally). k, v [Hkv, n, D] → [T, Hq, D]."""
    T, n = q.shape[0], k.shape[1]
    # the mask as a lower-right causal bias, which SDPA can run in its flash kernel (a tensor mask: the math path)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=causal_lower_right(T, n),
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[0])
    return o[0].transpose(0, 1)
