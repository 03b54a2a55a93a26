"""What every operation must produce, written again in numpy from the
header's and src/reference's definitions (summation orders included), so the
host backend's results are compared bit for bit with an independent
implementation. BF16 values are uint16 bits, FP8 values uint8 codes.
"""
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

import ep

E4M3_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)


@dataclass
class Topo:
    world: int
    num_experts: int
    topk: int
    hidden: int

    @property
    def local(self) -> int:
        return self.num_experts // self.world


@dataclass
class RankInput:
    x: np.ndarray          # [n, hidden] uint16 (BF16) or uint8 (FP8)
    scales: Optional[np.ndarray]  # [n, hidden/128] f32 for FP8
    topk_idx: np.ndarray   # [n, topk] int32
    weights: np.ndarray    # [n, topk] f32


def bf16(values: np.ndarray) -> np.ndarray:
    return ep.float_to_bf16_bits(values)


def f32(bits: np.ndarray) -> np.ndarray:
    return ep.bf16_bits_to_float(bits)


def random_input(rng: np.random.Generator, topo: Topo, n: int, drop: float = 0.2,
                 fp8: bool = False) -> RankInput:
    """Distinct experts per token, each slot dropped (-1) with probability ``drop``."""
    idx = np.array([rng.choice(topo.num_experts, topo.topk, replace=False) for _ in range(n)],
                   np.int32).reshape(n, topo.topk)
    idx[rng.random((n, topo.topk)) < drop] = -1
    weights = rng.random((n, topo.topk), dtype=np.float32)
    if fp8:
        codes = rng.integers(0, 0x7F, (n, topo.hidden), dtype=np.uint8)  # never NaN (0x7F)
        codes |= rng.integers(0, 2, (n, topo.hidden), dtype=np.uint8) << 7
        scales = (rng.random((n, topo.hidden // 128), dtype=np.float32) + 0.5) / 64
        return RankInput(codes, scales.astype(np.float32), idx, weights)
    x = bf16(rng.standard_normal((n, topo.hidden), dtype=np.float32))
    return RankInput(x, None, idx, weights)


def layout(topo: Topo, idx: np.ndarray):
    """(tokens per rank, pairs per expert, is_token_in_rank) of one rank's routing."""
    n = idx.shape[0]
    per_expert = np.zeros(topo.num_experts, np.int32)
    in_rank = np.zeros((n, topo.world), bool)
    for t in range(n):
        for e in idx[t]:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // topo.local] = True
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


@dataclass
class Dispatched:
    x: np.ndarray
    scales: Optional[np.ndarray]
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    src_info: np.ndarray
    expert_x: np.ndarray
    expert_scales: Optional[np.ndarray]
    expert_weights: np.ndarray
    expert_src_row: np.ndarray
    expert_offsets: np.ndarray
    expert_counts: np.ndarray


def dispatch(topo: Topo, inputs: List[RankInput], rank: int, alignment: int) -> Dispatched:
    """Normal-mode dispatch as rank ``rank`` receives it."""
    lo, hi = rank * topo.local, (rank + 1) * topo.local
    rows, idx_rows, w_rows, src = [], [], [], []
    scale_rows = []
    for s, inp in enumerate(inputs):
        for t in range(inp.topk_idx.shape[0]):
            ids = inp.topk_idx[t]
            mine = (ids >= lo) & (ids < hi)
            if not mine.any():
                continue
            rows.append(inp.x[t])
            if inp.scales is not None:
                scale_rows.append(inp.scales[t])
            idx_rows.append(np.where(mine, ids - lo, -1).astype(np.int32))
            w_rows.append(np.where(mine, inp.weights[t], np.float32(0)).astype(np.float32))
            src.append((s, t))
    h, k = topo.hidden, topo.topk
    x = np.array(rows, dtype=inputs[0].x.dtype).reshape(-1, h)
    scales = (np.array(scale_rows, np.float32).reshape(-1, h // 128)
              if inputs[0].scales is not None else None)
    topk_idx = np.array(idx_rows, np.int32).reshape(-1, k)
    weights = np.array(w_rows, np.float32).reshape(-1, k)
    src_info = np.array(src, np.int32).reshape(-1, 2)
    # Expert-major: each local expert's (row, slot) pairs in row order.
    per_expert = [[(i, int(np.nonzero(topk_idx[i] == e)[0][0]))
                   for i in range(x.shape[0]) if (topk_idx[i] == e).any()]
                  for e in range(topo.local)]
    counts = np.array([len(p) for p in per_expert], np.int32)
    padded = [(c + alignment - 1) // alignment * alignment for c in counts]
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    total = int(offsets[-1])
    ex = np.zeros((total, h), x.dtype)
    es = np.zeros((total, h // 128), np.float32) if scales is not None else None
    ew = np.zeros(total, np.float32)
    er = np.full(total, -1, np.int32)
    for e, pairs in enumerate(per_expert):
        for j, (i, slot) in enumerate(pairs):
            at = offsets[e] + j
            ex[at] = x[i]
            if es is not None:
                es[at] = scales[i]
            ew[at] = weights[i, slot]
            er[at] = i
    return Dispatched(x, scales, topk_idx, weights, src_info, ex, es, ew, er, offsets, counts)


def expert_partials(d: Dispatched, y: np.ndarray) -> np.ndarray:
    """Expert-major BF16 rows ``y`` weighted and reduced to one BF16 row per
    source-order row, summed in expert-major row order."""
    acc = np.zeros((d.x.shape[0], y.shape[1]), np.float32)
    for j in range(d.expert_src_row.shape[0]):
        i = d.expert_src_row[j]
        if i >= 0:
            acc[i] += d.expert_weights[j] * f32(y[j])
    return bf16(acc)


def combine(topo: Topo, rank: int, num_tokens: int, returned: List[tuple]) -> np.ndarray:
    """Normal-mode combine for ``rank``: ``returned[r]`` = (rows, src_info) of
    rank ``r``'s source-order rows; sums in f32, ranks then rows ascending."""
    acc = np.zeros((num_tokens, topo.hidden), np.float32)
    for rows, src_info in returned:
        for i in range(rows.shape[0]):
            if src_info[i, 0] == rank:
                acc[src_info[i, 1]] += f32(rows[i])
    return bf16(acc)


@dataclass
class LlDispatched:
    x: np.ndarray          # [L, W*M, hidden] source BF16 rows (before any quantization)
    count: np.ndarray      # [L]
    src_info: np.ndarray   # [L, W*M]
    layout_range: np.ndarray  # [L, W, 2]
    weights: np.ndarray    # [L, W*M] dispatch weights of each row (0 past the count)


def ll_dispatch(topo: Topo, m: int, inputs: List[RankInput], rank: int) -> LlDispatched:
    """Low-latency dispatch as ``rank`` receives it (rows as BF16, unquantized)."""
    cap = topo.world * m
    x = np.zeros((topo.local, cap, topo.hidden), np.uint16)
    count = np.zeros(topo.local, np.int32)
    src_info = np.zeros((topo.local, cap), np.int32)
    ranges = np.zeros((topo.local, topo.world, 2), np.int32)
    weights = np.zeros((topo.local, cap), np.float32)
    for le in range(topo.local):
        expert = rank * topo.local + le
        c = 0
        for s, inp in enumerate(inputs):
            first = c
            for t in range(inp.topk_idx.shape[0]):
                for slot in range(topo.topk):
                    if inp.topk_idx[t, slot] == expert:
                        x[le, c] = inp.x[t]
                        src_info[le, c] = t
                        weights[le, c] = inp.weights[t, slot]
                        c += 1
            ranges[le, s] = (first, c - first)
        count[le] = c
    return LlDispatched(x, count, src_info, ranges, weights)


def ll_combine_weighted(topo: Topo, rank: int, idx: np.ndarray, weights: np.ndarray,
                        experts: List[tuple]) -> np.ndarray:
    """LL combine, weights at combine: ``experts[r]`` = (y [L, W*M, H], layout_range)."""
    n = idx.shape[0]
    matched = np.zeros(topo.num_experts, np.int64)
    out = np.zeros((n, topo.hidden), np.float32)
    for t in range(n):
        acc = np.zeros(topo.hidden, np.float32)
        for slot in range(topo.topk):
            e = idx[t, slot]
            if e < 0:
                continue
            r, le = e // topo.local, e % topo.local
            y, ranges = experts[r]
            row = ranges[le, rank, 0] + matched[e]
            matched[e] += 1
            acc += weights[t, slot] * f32(y[le, row])
        out[t] = acc
    return bf16(out)


def ll_combine_pre_weighted(topo: Topo, rank: int, idx: np.ndarray,
                            experts: List[tuple]) -> np.ndarray:
    """LL combine, weights at dispatch: ``experts[r]`` = (y, layout_range,
    src_info, row weights); each rank's partial is rounded to BF16 first."""
    n = idx.shape[0]
    total = np.zeros((n, topo.hidden), np.float32)
    for r, (y, ranges, src_info, w) in enumerate(experts):
        partial = np.zeros((n, topo.hidden), np.float32)
        for le in range(topo.local):
            first, cnt = ranges[le, rank]
            for row in range(first, first + cnt):
                partial[src_info[le, row]] += w[le, row] * f32(y[le, row])
        uses = ((idx >= r * topo.local) & (idx < (r + 1) * topo.local)).any(1)
        total[uses] += f32(bf16(partial[uses]))
    return bf16(total)


def e4m3_to_float(codes: np.ndarray) -> np.ndarray:
    """FP8 e4m3 codes -> float32 (NaN for 0x7F / 0xFF)."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    mant = c & 7
    value = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7))
    value = np.where((c & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


def check_fp8_rows(codes: np.ndarray, scales: np.ndarray, rows: np.ndarray) -> None:
    """FP8 rows and their per-128 scales dequantize to the BF16 ``rows``
    within e4m3's precision, and each scale is the block's amax / 448."""
    x = f32(rows).reshape(rows.shape[0], -1, 128)
    amax = np.maximum(np.abs(x).max(axis=2), AMAX_FLOOR)
    np.testing.assert_allclose(scales, amax / E4M3_MAX, rtol=1e-6)
    deq = e4m3_to_float(codes).reshape(x.shape) * scales[:, :, None]
    tolerance = np.abs(x) / 16 + (amax / E4M3_MAX)[:, :, None] * 2.0 ** -9
    bad = np.abs(deq - x) > tolerance
    assert not bad.any(), f"{bad.sum()} FP8 values outside e4m3 precision"
