"""Where the KV cache goes, for the placement search (`search.py`): how many tokens per sequence
the device tier holds, how many of the host tier's the GPU attends over after copying them up
(streamed), and what each choice costs in device and host memory.
"""
from __future__ import annotations

from cpu_attention.layout import KVDtype
from hetero.config import ModelConfig
from hetero.errors import UserError
from planner.plan import KVPlan
from planner.tensors import kv_bytes_per_seq_layer, kv_bytes_per_token_layer
from planner.units import format_size as fs

# shares of what fits, tried as device tiers that leave staging room. Half: where the device tier
# is a sliver of a long context, each token it gives up makes room to stream ~L/2 more (1 x 128k,
# 6 GiB: 2080 device tokens and 67328 streamed measured 14.2 tok/s against 9.1 for 3744 and 18912)
GPU_TIER_FOR_STREAMING = (0.5, 0.9, 0.95, 0.98)
STREAM_SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # of the host tier's tokens, tried for the GPU's streamed share


def gpu_tail_bytes(cfg: ModelConfig, gpu_dt: KVDtype, block: int, batch: int) -> int:
    """Device memory a quantized device tier adds besides its blocks: a bf16 tail of every layer
    for each sequence's block being filled, and a scratch one (gpu_ops/kv_pool.py)."""
    if gpu_dt not in (KVDtype.INT8, KVDtype.INT4):
        return 0
    return (batch + 2) * cfg.num_layers * 4 * cfg.num_kv_heads * block * cfg.head_dim


def gpu_token_options(cfg, hw, wl, ov, left, block, gpu_dt, host_dt, threads, readback):
    """(GPU-tier tokens per sequence, extra GPU bytes, reason) to try: as many as fit, and the
    split where GPU and CPU attention take equal time, if smaller. `readback` is the prefill
    buffer a host tier needs when it was not reserved already."""
    left -= gpu_tail_bytes(cfg, gpu_dt, block, wl.batch)
    per_tok = wl.batch * cfg.num_layers * kv_bytes_per_token_layer(cfg, gpu_dt, block)
    fit = min(wl.ctx_size, int(left // per_tok) // block * block)
    if ov.gpu_kv_tokens is not None:
        if ov.gpu_kv_tokens > wl.ctx_size:
            raise UserError(f"--gpu-kv-tokens {ov.gpu_kv_tokens} exceeds the context ({wl.ctx_size} tokens): "
                            "lower it or raise --ctx-size")
        if ov.gpu_kv_tokens > fit:
            raise UserError(
                f"--gpu-kv-tokens {ov.gpu_kv_tokens} needs {fs(ov.gpu_kv_tokens * per_tok)} on cuda:0, "
                f"{fs(max(0, left))} is left after weights: lower --gpu-kv-tokens or raise --gpu-mem"
            )
        return [(ov.gpu_kv_tokens, 0, "set by the user")]
    out = [(fit, 0, "the whole context fits" if fit == wl.ctx_size else "what fits after the weights")]
    if hw.has_gpu and block < fit < wl.ctx_size:
        # a smaller device tier leaves room to stream a share of the host tier: a streamed token
        # takes 2 staging slots of one layer, a device-tier token every layer (≈ L/2 times more)
        for keep in GPU_TIER_FOR_STREAMING:
            n = int(fit * keep) // block * block
            if n and readback <= left - n * per_tok:
                out.append((n, readback, "a smaller device tier, leaving room to stream more of the host tier"))
    if hw.gpu_attention_gbps and fit:
        a_g = kv_bytes_per_token_layer(cfg, gpu_dt, block) / hw.gpu_attention_rate(gpu_dt)
        a_c = kv_bytes_per_token_layer(cfg, host_dt, block) / max(hw.cpu_attention_rate(host_dt, threads), 1e-9)
        balanced = int(wl.decode_context * a_c / (a_g + a_c)) // block * block
        if 0 < balanced < fit and balanced * per_tok + readback <= left:
            out.append((balanced, readback, "GPU and CPU attention finish together"))
    return out


def stream_staging_bytes(cfg: ModelConfig, host_dt: KVDtype, tokens: int, block: int, rows: int = 1) -> int:
    """Device memory the KV streamer needs (offload/stream.py): two layer slots of `tokens` tokens a
    row in the host tier's own format (the device attends over those bytes as they are)."""
    return int(2 * rows * tokens * kv_bytes_per_token_layer(cfg, host_dt, block))


def stream_options(cfg, hw, wl, ov, kv: KVPlan, left: float) -> list[tuple[int, int, str]]:
    """(streamed tokens a sequence, staging bytes, reason) to try: none, and shares of the host tier
    that fit (staging for every row of the batch, in one sub-batch or two)."""
    if ov.stream_tokens is not None:
        if ov.stream_tokens and not hw.has_gpu:
            raise UserError("--kv-stream-tokens needs a GPU: drop it or use --device cuda")
        need = stream_staging_bytes(cfg, kv.host_dtype, ov.stream_tokens, kv.block_size, wl.batch)
        if ov.stream_tokens and need > left:
            raise UserError(f"--kv-stream-tokens {ov.stream_tokens} needs {fs(need)} of staging on cuda:0, "
                            f"{fs(max(0, left))} is left: lower it or raise --gpu-mem")
        return [(ov.stream_tokens, need if ov.stream_tokens else 0, "set by the user")]
    out = [(0, 0, "the CPU attends over the whole host tier")]
    if not hw.has_gpu:
        return out
    # shares of the host tier at the answer's mean context and at its latest one the mean weighs (a
    # sequence streams at most what it holds: a larger share costs nothing until its host tier grows),
    # and as many as the staging room takes
    per_tok = stream_staging_bytes(cfg, kv.host_dtype, 1, kv.block_size, wl.batch)
    fit = int(left // per_tok) // kv.block_size * kv.block_size
    tokens = set()
    for ctx in (wl.decode_context, max(wl.decode_contexts())):
        host = min(ctx - kv.gpu_tokens, kv.host_tokens)
        if host >= 2 * kv.block_size:
            tokens.update(int(host * share) // kv.block_size * kv.block_size for share in STREAM_SHARES)
            tokens.add(min(fit, host // kv.block_size * kv.block_size))
    for n in sorted(tokens):
        need = stream_staging_bytes(cfg, kv.host_dtype, n, kv.block_size, wl.batch)
        if n and need <= left:
            out.append((n, need, f"the GPU attends over the first {n} host-tier tokens of each sequence, copied "
                                  "up over PCIe while the CPU attends over the rest"))
    return out


def kv_plan(cfg, wl, block, gpu_tokens, gpu_dt, host_dt) -> KVPlan:
    """The KV tiers with gpu_tokens per sequence on the device and the rest of the context on the
    host, and their bytes."""
    host_tokens = wl.ctx_size - gpu_tokens
    host_tokens = -(-host_tokens // block) * block
    L = cfg.num_layers
    # host: the tokens, plus what each sequence holds besides them (int4: the block being filled, in bf16)
    per_seq = host_tokens * kv_bytes_per_token_layer(cfg, host_dt, block) + kv_bytes_per_seq_layer(cfg, host_dt, block)
    gpu_bytes = wl.batch * gpu_tokens * L * kv_bytes_per_token_layer(cfg, gpu_dt, block)
    if gpu_tokens:
        gpu_bytes += gpu_tail_bytes(cfg, gpu_dt, block, wl.batch)
    return KVPlan(block, gpu_tokens, host_tokens, gpu_dt, host_dt, int(gpu_bytes), int(wl.batch * L * per_seq))
