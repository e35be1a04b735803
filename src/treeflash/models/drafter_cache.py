"""The DFlash drafter's per-request cache of committed context K/V (`DrafterCache`): one
`LayerKV` a layer (full layers grow by doubling, sliding layers keep a ring of the last W-1
positions), with buffers of finished requests handed on by a `KVBufferPool`."""

from __future__ import annotations

import torch


class LayerKV:
    """Committed context K/V of one layer of one request.

    Full layers keep every position in a buffer that grows by doubling. Sliding layers keep
    a ring of the last W-1 positions: a block query at p >= start sees context j iff
    p - j < W, so nothing older than start-(W-1) is ever visible. Order inside the ring
    does not matter to attention; `pos` records each slot's absolute position for the mask.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        window: int | None,
        device: torch.device,
        dtype: torch.dtype,
        pool: KVBufferPool | None = None,
        layer: int = 0,
    ):
        self.window = window
        self.pool, self.layer = pool, layer
        self._shape = (n_kv_heads, head_dim, device, dtype)
        cap = 16 if window is None else max(window - 1, 0)
        self.k, self.v, self.pos = self._buffers(cap)
        self.n = 0  # valid slots
        self.head = 0  # next ring slot (sliding layers)

    def _buffers(self, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [Hkv, cap, D] and pos [cap] = -1: a finished request's (the pool) or new."""
        h, d, device, dtype = self._shape

        def fresh():
            k = torch.zeros(h, cap, d, device=device, dtype=dtype)
            return k, torch.zeros_like(k), torch.full((cap,), -1, dtype=torch.long, device=device)

        return fresh() if self.pool is None else self.pool.take((self.layer, cap), fresh)

    def release(self) -> None:
        """Hand the buffers to the pool (the request is done; this LayerKV is dead)."""
        if self.pool is not None:
            self.pool.give((self.layer, self.capacity), (self.k, self.v, self.pos))
        self.k = self.v = self.pos = None

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v [Hkv, T, D]; pos [T] absolute positions, increasing."""
        if self.window is None:
            self._append_full(k, v, pos)
        else:
            self._append_ring(k, v, pos)

    def _append_full(self, k, v, pos) -> None:
        t = k.shape[1]
        self.reserve(t)
        self.k[:, self.n : self.n + t] = k
        self.v[:, self.n : self.n + t] = v
        self.pos[self.n : self.n + t] = pos
        self.n += t

    def _append_ring(self, k, v, pos) -> None:
        cap, t = self.capacity, k.shape[1]
        if cap == 0:
            return
        if t >= cap:
            self.k[:], self.v[:], self.pos[:] = k[:, -cap:], v[:, -cap:], pos[-cap:]
            self.head, self.n = 0, cap
            return
        idx = (self.head + torch.arange(t, device=self.k.device)) % cap
        self.k[:, idx], self.v[:, idx], self.pos[idx] = k, v, pos
        self.head = (self.head + t) % cap
        self.n = min(self.n + t, cap)

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [Hkv, n, D] and pos [n] of the valid slots."""
        return self.k[:, : self.n], self.v[:, : self.n], self.pos[: self.n]

    # ---- the static append (CUDA graphs): slots from a device index, bookkeeping on the host
    def reserve(self, t: int) -> int:
        """Make room for t rows (a full layer grows now, on the host) and return the first
        slot they go to: n for a full layer, the ring head for a sliding one."""
        if self.window is None:
            if self.n + t > self.capacity:
                old, n = (self.k, self.v, self.pos), self.n
                # a power of two: requests of similar lengths meet the same capacities, so the
                # pooled buffers (and the draft graphs captured over them) serve them all
                cap = _pow2(max(2 * self.capacity, self.n + t))
                self.k, self.v, self.pos = self._buffers(cap)
                self.k[:, :n], self.v[:, :n], self.pos[:n] = old[0][:, :n], old[1][:, :n], old[2][:n]
                if self.pool is not None:
                    self.pool.give((self.layer, old[0].shape[1]), old)
            return self.n
        return self.head

    def write_at(self, first: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 count: torch.Tensor | None = None) -> None:
        """k, v [Hkv, T, D] into slots first + 0..T-1 (mod the ring), first a device scalar.

        count (a device scalar, 1 <= count <= T): append only rows 0..count-1, each to the slot
        append() of those rows would give it, and leave every other slot as it was. T then
        stays fixed whatever count is, so one CUDA graph serves any count; a full layer must
        have room for all T rows (reserve(T))."""
        if self.capacity == 0:
            return
        if count is None:
            idx = first + torch.arange(k.shape[1], device=k.device)
            if self.window is not None:
                idx = idx % self.capacity
        else:
            idx, src, keep = self._masked_slots(first, k.shape[1], count)
            if src is not None:
                k, v, pos = k[:, src], v[:, src], pos[src]
            k = torch.where(keep[None, :, None], k, self.k[:, idx])
            v = torch.where(keep[None, :, None], v, self.v[:, idx])
            pos = torch.where(keep, pos, self.pos[idx])
        self.k.index_copy_(1, idx, k)
        self.v.index_copy_(1, idx, v)
        self.pos.index_copy_(0, idx, pos)

    def _masked_slots(self, first: torch.Tensor, t: int, count: torch.Tensor):
        """(slots, source rows or None for rows 0..t-1 in order, keep) of a count-of-t append
        from slot `first`: distinct slots (at most the ring's capacity), so writes never collide."""
        j = torch.arange(t if self.window is None else min(t, self.capacity), device=first.device)
        if self.window is None:
            return first + j, None, j < count
        slot = (first + j) % self.capacity
        wrap = count >= self.capacity  # append() keeps the last `capacity` rows, in slots 0..cap-1
        return slot, torch.where(wrap, slot + count - self.capacity, j), wrap | (j < count)

    def advance(self, t: int) -> None:
        """The host's side of a static append of t rows (what append() does to n / head)."""
        if self.window is None:
            self.n += t
        elif self.capacity:
            self.head = 0 if t >= self.capacity else (self.head + t) % self.capacity
            self.n = min(self.n + t, self.capacity)

    def presize(self, rows: int) -> None:
        """A full layer, still empty, grows now to hold `rows` (rounded up to a power of two): a
        request reserved for its prompt and max tokens never grows mid-stream, where a new
        capacity is a new draft graph captured inside a served step (speculative/draft_graphs.py)."""
        if self.window is None and self.n == 0 and rows > self.capacity:
            if self.pool is not None:
                self.pool.give((self.layer, self.capacity), (self.k, self.v, self.pos))
            self.k, self.v, self.pos = self._buffers(_pow2(rows))

    def full_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slot (capacity): unused ones have pos -1 and are masked out. Fixed shapes
        and addresses until the buffer grows, so a captured proposal can read it in place."""
        return self.k, self.v, self.pos


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class KVBufferPool:
    """Spare drafter-cache buffers by (layer, capacity). A finished request's buffers serve
    the next request, so a request that grows its cache along the same capacities meets the
    same buffers, at the same addresses, that the captured draft graphs read: they replay
    instead of being captured again for every request (speculative/draft_graphs.py). Unused slots
    need only pos = -1 (masked); stale K/V values there are never read unmasked."""

    def __init__(self, per_key: int = 2):
        self.per_key = per_key
        self.spare: dict[tuple[int, int], list[tuple]] = {}

    def take(self, key: tuple[int, int], make):
        bufs = self.spare.get(key)
        if bufs and bufs[-1][2].is_inference() and not torch.is_inference_mode_enabled():
            bufs.clear()  # made under inference_mode: not writable outside it
        if not bufs:
            return make()
        k, v, pos = bufs.pop()
        pos.fill_(-1)
        return k, v, pos

    def give(self, key: tuple[int, int], buffers: tuple) -> None:
        bufs = self.spare.setdefault(key, [])
        if len(bufs) < self.per_key and all(b.data_ptr() != buffers[0].data_ptr() for b, _, _ in bufs):
            bufs.append(buffers)


class DrafterCache:
    """One request's drafter state: committed-context K/V per layer, nothing else."""

    def __init__(self, layers: list[LayerKV]):
        self.layers = layers
        self.seq_len = 0  # committed positions appended so far

    def release(self) -> None:
        """The request is done: its buffers go back to the drafter's pool (if it has one)."""
        for layer in self.layers:
            layer.release()

    def num_cached(self) -> list[int]:
        return [layer.n for layer in self.layers]

    def reserve(self, t: int) -> list[int]:
        """Room for t more rows in every layer (a full layer grows now, on the host); each
        layer's first slot for them (see LayerKV.reserve)."""
        return [layer.reserve(t) for layer in self.layers]

    def presize(self, rows: int) -> None:
        """Room for `rows` positions in every full layer before the first append (LayerKV.presize)."""
        for layer in self.layers:
            layer.presize(rows)

    def advance(self, t: int) -> None:
        """The host's side of a static append of t rows, once the device has written them."""
        for layer in self.layers:
            layer.advance(t)
        self.seq_len += t
