"""A numpy quantizer of the K-quant types (Q4_K, Q5_K, Q6_K) for tests: gguf-py only
decodes them. Simple min/max scales (llama.cpp searches for better ones), but the
blocks are valid and gguf's own dequantize reads them back (tests/model/test_kquants.py
checks the round trip)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[B, 8] 6-bit scales and mins -> [B, 12] bytes (inverse of gguf's Q4_K.get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _q45k(x: np.ndarray, bits: int) -> np.ndarray:
    """Rows of x [N, K] as Q4_K (bits 4) or Q5_K (bits 5) blocks: [N, K / 256 * bytes]."""
    n, k = x.shape
    xb = x.reshape(-1, 8, 32).astype(np.float32)  # [B, sub-block, value]
    levels = (1 << bits) - 1
    lo = np.minimum(xb.min(-1), 0.0)
    scale = (xb.max(-1) - lo) / levels  # [B, 8]
    mins = -lo
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(mins.max(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        mq = np.where(dmin32 > 0, np.rint(mins / dmin32), 0).clip(0, 63).astype(np.uint8)
        d1, m1 = (d32 * sc)[..., None], (dmin32 * mq)[..., None]
        q = np.where(d1 > 0, np.rint((xb + m1) / d1), 0).clip(0, levels).astype(np.uint8)
    low = q & 0xF
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(-1, 128)  # [B, 4 pairs * 32]
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scales_k4(sc, mq)]
    if bits == 5:
        qh = np.zeros((xb.shape[0], 32), dtype=np.uint8)
        for j in range(8):
            qh |= ((q[:, j, :] >> 4) & 1) << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(n, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    return _q45k(x, 4)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    return _q45k(x, 5)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of x [N, K] as Q6_K blocks: [N, K / 256 * 210]."""
    n, k = x.shape
    xb = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(xb).max(-1) / 32  # [B, 16]
    d = _f16(scale.max(-1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d.astype(np.float32)[:, None]), 0).clip(-128, 127)
        step = d.astype(np.float32)[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(xb / step[..., None]), 0).clip(-32, 31)
    code = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # value h*128 + s*32 + l
    ql = np.zeros((code.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((code.shape[0], 2, 32), dtype=np.uint8)
    for s in range(4):
        ql[:, :, (s % 2) * 32:(s % 2) * 32 + 32] |= (code[:, :, s, :] & 0xF) << (4 * (s // 2))
        qh |= (code[:, :, s, :] >> 4) << (2 * s)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
             d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, axis=1).reshape(n, -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x [N, K] float32 as GGUF blocks of type_name (K-quants here, the rest by gguf-py)."""
    if type_name in QUANTIZERS:
        return QUANTIZERS[type_name](np.ascontiguousarray(x, dtype=np.float32))
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), gguf.GGMLQuantizationType[type_name])
