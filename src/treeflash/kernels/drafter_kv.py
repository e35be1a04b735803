"""The DFlash drafter's cache append in one launch: every layer's k_norm + rotary and the K, V
and position writes of T committed rows (`DFlashDrafter.extend_static`).

Why: the graphed append of the shipped pair was ~20 kernels (positions, six cos/sin ops, per
layer two GEMMs, the norm + rotary, and `LayerKV.write_at`'s slot arithmetic and three
index_copy_), each ~2.5 us of H200 device time for a few KB of data. With one GEMM producing
every layer's k and v (`kv` below), this kernel does the rest: one program a row t computes
its position start + t, cos/sin from position * inv_freq in float32 (times the rotary's scale,
then rounded to the model dtype, as `Rotary.cos_sin` does), and for each layer normalises and
rotates its k heads (`norm_rope._rope_kernel`'s arithmetic and rounding points) and stores k,
v and the position into the layer's slot for the row:

- a full layer: slot first[l] + t;
- a sliding ring of capacity C: slot (first[l] + t) % C; with count >= C (the masked append
  of a whole ring or more) rows count-C .. count-1 go to slots 0 .. C-1 (`append` keeps the
  last C rows); without count and T > C only the last C rows are stored (the last write of
  `write_at`'s index_copy_);
- with count (a device scalar, the masked append): rows >= count store nothing.

Slots and kept rows are those of `LayerKV.write_at` / `_masked_slots`, written per source row
here (`drafter_kv_write_torch` is the twin in their slot-per-row form). Layers of capacity 0
are skipped; up to MAX_LAYERS layers go in one launch (their buffers as separate arguments:
fixed addresses for a given cache buffer set, so the launch is CUDA-graph safe), more take one
launch per MAX_LAYERS. Compiled without FP contraction, as norm_rope is (its docstring says why).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_LAYERS = 4  # layers a launch takes; a drafter with more takes ceil(L / 4) launches


@triton.jit
def _round(v, DT: tl.constexpr):
    return v.to(DT).to(tl.float32)


@triton.jit
def _write_layer(KV, K, V, P, W, CAP, LAYER, FIRST, s_first, s_kv, s_layer, r, pos, c, s, cnt, T, H, HALF, eps,
                 RING: tl.constexpr, HAS_COUNT: tl.constexpr, INTERLEAVE: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Row r of layer LAYER (cache K, V [H, CAP, 2*HALF], P [CAP]; k_norm weight W)."""
    first = tl.load(FIRST + LAYER * s_first).to(tl.int64)
    if RING:
        if HAS_COUNT:
            wrap = cnt >= CAP  # the last CAP rows of the count, in slots 0..CAP-1
            slot = tl.where(wrap, r - (cnt - CAP), (first + r) % CAP)
            keep = (r < cnt) & ((r >= cnt - CAP) | (cnt < CAP))
        else:
            slot = (first + r) % CAP
            keep = r >= T - CAP  # rows older than the last CAP would be overwritten
    else:
        slot = first + r
        if HAS_COUNT:
            keep = r < cnt
        else:
            keep = r < T
    hs = tl.arange(0, BLOCK_H)[:, None]
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (hs < H) & (ds < HALF)
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3)...: evens and odds
        i1, i2 = 2 * ds, 2 * ds + 1
    else:
        i1, i2 = ds, HALF + ds
    D = 2 * HALF
    src = KV + r * s_kv + LAYER * s_layer + hs * D  # layer LAYER's k heads, then its v heads
    x1 = tl.load(src + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=ok, other=0.0).to(tl.float32)
    DT: tl.constexpr = KV.dtype.element_ty
    # k_norm (RMSNorm over the head dim) then the rotation: _rope_kernel's arithmetic, op for op
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + i1, mask=ds < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(W + i2, mask=ds < HALF, other=0.0).to(tl.float32)
    x1 = _round(w1 * _round(x1 * rstd, DT), DT)
    x2 = _round(w2 * _round(x2 * rstd, DT), DT)
    o1 = _round(x1 * c, DT) - _round(x2 * s, DT)
    o2 = _round(x2 * c, DT) + _round(x1 * s, DT)
    m = (hs < tl.where(keep, H, 0)) & (ds < HALF)  # ok & keep (a scalar & a block: int32 in the interpreter)
    row = hs.to(tl.int64) * CAP * D + slot * D  # [H, CAP, D] contiguous
    tl.store(K + row + ds, o1.to(K.dtype.element_ty), mask=m)
    tl.store(K + row + HALF + ds, o2.to(K.dtype.element_ty), mask=m)
    v1 = tl.load(src + H * D + ds, mask=ok, other=0.0)
    v2 = tl.load(src + H * D + HALF + ds, mask=ok, other=0.0)
    tl.store(V + row + ds, v1.to(V.dtype.element_ty), mask=m)
    tl.store(V + row + HALF + ds, v2.to(V.dtype.element_ty), mask=m)
    tl.store(P + slot, pos, mask=keep)


@triton.jit
def _drafter_kv_kernel(KV, s_kv, s_layer, START, FIRST, s_first, COUNT, INV_FREQ, scale, eps, T, H, HALF,
                       K0, V0, P0, W0, CAP0, L0, K1, V1, P1, W1, CAP1, L1,
                       K2, V2, P2, W2, CAP2, L2, K3, V3, P3, W3, CAP3, L3,
                       NL: tl.constexpr, RING0: tl.constexpr, RING1: tl.constexpr, RING2: tl.constexpr,
                       RING3: tl.constexpr, HAS_COUNT: tl.constexpr, SCALE: tl.constexpr,
                       INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # source row; one program writes it into every layer
    pos = tl.load(START).to(tl.int64) + r
    if HAS_COUNT:
        cnt = tl.load(COUNT).to(tl.int64)
    else:
        cnt = r  # unused
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    # Rotary.cos_sin: position (float32) * inv_freq (its dtype, widened), cos/sin in float32,
    # times the scale unless it is 1, rounded to the model dtype
    f = pos.to(tl.float32) * tl.load(INV_FREQ + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    c = tl.cos(f)
    s = tl.sin(f)
    if SCALE:
        c = c * scale
        s = s * scale
    DT: tl.constexpr = KV.dtype.element_ty
    c = _round(c, DT)
    s = _round(s, DT)
    _write_layer(KV, K0, V0, P0, W0, CAP0, L0, FIRST, s_first, s_kv, s_layer, r, pos, c, s, cnt, T, H, HALF, eps,
                 RING0, HAS_COUNT, INTERLEAVE, BLOCK_H, BLOCK_HALF)
    if NL > 1:
        _write_layer(KV, K1, V1, P1, W1, CAP1, L1, FIRST, s_first, s_kv, s_layer, r, pos, c, s, cnt, T, H, HALF,
                     eps, RING1, HAS_COUNT, INTERLEAVE, BLOCK_H, BLOCK_HALF)
    if NL > 2:
        _write_layer(KV, K2, V2, P2, W2, CAP2, L2, FIRST, s_first, s_kv, s_layer, r, pos, c, s, cnt, T, H, HALF,
                     eps, RING2, HAS_COUNT, INTERLEAVE, BLOCK_H, BLOCK_HALF)
    if NL > 3:
        _write_layer(KV, K3, V3, P3, W3, CAP3, L3, FIRST, s_first, s_kv, s_layer, r, pos, c, s, cnt, T, H, HALF,
                     eps, RING3, HAS_COUNT, INTERLEAVE, BLOCK_H, BLOCK_HALF)


def _check(kv, layers, first, inv_freq):
    """(T, Hkv, D, layer stride of kv) after the contract's checks (`kernels.drafter_kv_write`)."""
    t = kv.shape[-2] if kv.dim() == 3 else kv.shape[0]
    if not layers:
        return t, 0, 0, 0
    h, _, d = layers[0][0].shape
    n = len(layers)
    if kv.dim() == 3:  # [L, T, 2 Hkv D]: a batched GEMM's output (any layer and row strides)
        ok = kv.shape[0] == n and kv.shape[2] == 2 * h * d and kv.stride(2) == 1
        s_layer = kv.stride(0)
    else:
        ok = kv.dim() == 2 and kv.shape[1] == n * 2 * h * d and kv.stride(1) == 1
        s_layer = 2 * h * d
    if not ok:
        raise ValueError(f"kv must be [T, {n} * 2 * {h} * {d}] or [{n}, T, 2 * {h} * {d}] with unit "
                         f"column stride, got {tuple(kv.shape)} strides {tuple(kv.stride())}")
    if first.shape[0] < len(layers) or d % 2 or inv_freq.shape[-1] != d // 2:
        raise ValueError("first needs a slot per layer and inv_freq head_dim / 2 entries")
    for k, v, pos, w, _ in layers:
        if k.shape != v.shape or k.shape[0] != h or k.shape[2] != d or not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("every layer's k / v cache must be a contiguous [Hkv, capacity, head_dim]")
        if pos.shape != (k.shape[1],) or not pos.is_contiguous() or w.shape != (d,):
            raise ValueError("pos must be [capacity] and the k_norm weight [head_dim]")
    return t, h, d, s_layer


def drafter_kv_write_triton(kv, start, first, count, layers, inv_freq, scale, interleave, eps):
    """Triton twin of `drafter_kv_write_torch` (same contract)."""
    t, h, d, s_layer = _check(kv, layers, first, inv_freq)
    if t == 0:
        return
    active = [(i, layer) for i, layer in enumerate(layers) if layer[0].shape[1] > 0]
    half = d // 2
    count_arg = start if count is None else count
    for c0 in range(0, len(active), MAX_LAYERS):
        chunk = active[c0:c0 + MAX_LAYERS]
        args, rings = [], []
        for j in range(MAX_LAYERS):
            i, (k, v, pos, w, ring) = chunk[min(j, len(chunk) - 1)]  # unused slots repeat the last layer
            args += [k, v, pos, w, k.shape[1], i]
            rings.append(bool(ring))
        _drafter_kv_kernel[(t,)](
            kv, kv.stride(-2), s_layer, start, first, first.stride(0), count_arg, inv_freq, float(scale), float(eps), t,
            h, half, *args, NL=len(chunk), RING0=rings[0], RING1=rings[1], RING2=rings[2], RING3=rings[3],
            HAS_COUNT=count is not None, SCALE=scale != 1.0, INTERLEAVE=bool(interleave),
            BLOCK_H=triton.next_power_of_2(h), BLOCK_HALF=triton.next_power_of_2(half), num_warps=1,
            enable_fp_fusion=False,  # else x1*c - r(x2*s) becomes one bf16 FMA: not torch's rounding
        )


def drafter_kv_write_torch(kv, start, first, count, layers, inv_freq, scale, interleave, eps):
    """The torch twin: `Rotary.cos_sin`, `reference.rope` (k_norm first) and `LayerKV.write_at`
    (its `_masked_slots` with count), layer by layer. Contract: `kernels.drafter_kv_write`."""
    from treeflash.kernels import reference

    t, h, d, _ = _check(kv, layers, first, inv_freq)
    if t == 0:
        return
    positions = start.reshape(-1)[0] + torch.arange(t, device=kv.device)
    freqs = positions[:, None].float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(kv.dtype), sin.to(kv.dtype)
    for i, (kc, vc, pc, w, ring) in enumerate(layers):
        cap = kc.shape[1]
        if cap == 0:
            continue
        row = kv[i] if kv.dim() == 3 else kv[:, i * 2 * h * d:(i + 1) * 2 * h * d]  # [T, 2 Hkv D]
        k = row[:, :h * d].unflatten(-1, (h, d))
        v = row[:, h * d:].unflatten(-1, (h, d))
        k = reference.rope(k, cos, sin, interleave, norm_weight=w, eps=eps).transpose(0, 1)  # [H, T, D]
        v, pos, f = v.transpose(0, 1), positions, first[i]
        if count is None:
            j = torch.arange(max(t - cap, 0) if ring else 0, t, device=kv.device)  # the last write wins
            idx = f + j
            if ring:
                idx = idx % cap
            k, v, pos = k[:, j], v[:, j], pos[j]
        else:
            n = count.reshape(-1)[0]
            j = torch.arange(min(t, cap) if ring else t, device=kv.device)
            if ring:  # LayerKV._masked_slots
                idx = (f + j) % cap
                wrap = n >= cap
                src, keep = torch.where(wrap, idx + n - cap, j), wrap | (j < n)
                k, v, pos = k[:, src], v[:, src], pos[src]
            else:
                idx, keep = f + j, j < n
            k = torch.where(keep[None, :, None], k, kc[:, idx])
            v = torch.where(keep[None, :, None], v, vc[:, idx])
            pos = torch.where(keep, pos, pc[idx])
        kc.index_copy_(1, idx, k.to(kc.dtype))
        vc.index_copy_(1, idx, v.to(vc.dtype))
        pc.index_copy_(0, idx, pos)
