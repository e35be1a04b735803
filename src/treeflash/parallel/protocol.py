"""The step messages rank 0 sends its followers: a fixed int64 header, then the tensors.

Header (HEADER_LEN int64): magic, version, sequence number, op, then the op's sizes.
Every tensor that follows has a shape computed from the header alone, so a follower
knows what to receive before it receives it, and checks everything it can (magic,
version, sequence, op, sizes within the pool) before touching its model or cache.
Nothing is pickled; a malformed message raises `ProtocolError` and the follower exits.

  FORWARD  B, N, P, has_mask, F, later  ints  [B*N ids | B*N positions | B*P pages | B prefix lens]
                                         mask  [B, N, N] uint8 (if has_mask)
  COMMIT   B, M, P, F           ints  [B*P pages | B prefix lens | B*M accept idx | B rows]
  MOVE     K                    ints  [K source pages | K destination pages]  (`kvcache.defrag`)

later: a verify, whose rows the COMMIT that follows places (decode context parallelism).
F: the pages of the table are the pool's coarse pages of F pages each (`KVPool.kv_as(F)`;
1: the pool's own pages), as rank 0's executor chose for the batch (`engine.executor.PagedKV`).
  INIT     pages, page_size, latent dim, layers, dtype code, kv format   (no tensors)
           (dtype: the values'; kv format: KV_FORMATS, e.g. fp8_e4m3 rows, `kvcache.format`)
  SHUTDOWN                     (no tensors)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

MAGIC = 0x7F1A5D
VERSION = 3
HEADER_LEN = 12
MAX_ROWS = 1 << 22  # B*N per step: far above any real step, small enough to catch garbage

DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16, 4: torch.uint8}  # 4: fp8 rows' storage
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
KV_FORMATS = {0: "auto", 1: "fp8_e4m3"}  # the pool's row format (`kvcache.format`)
KV_FORMAT_CODES = {v: k for k, v in KV_FORMATS.items()}


class Op(IntEnum):
    FORWARD = 1
    COMMIT = 2
    INIT = 3
    SHUTDOWN = 4
    MOVE = 5


class ProtocolError(RuntimeError):
    """A follower received a message that does not fit the schema: the group is out of step."""


@dataclass(frozen=True)
class Header:
    seq: int
    op: Op
    args: tuple[int, ...] = ()

    def encode(self) -> torch.Tensor:
        if len(self.args) > HEADER_LEN - 4:
            raise ProtocolError(f"{self.op.name}: {len(self.args)} header fields, at most {HEADER_LEN - 4}")
        fields = [MAGIC, VERSION, self.seq, int(self.op), *self.args]
        return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)

    @staticmethod
    def decode(t: torch.Tensor, expect_seq: int) -> Header:
        if t.shape != (HEADER_LEN,) or t.dtype != torch.int64:
            raise ProtocolError(f"header must be int64 [{HEADER_LEN}], got {t.dtype} {tuple(t.shape)}")
        v = t.tolist()
        if v[0] != MAGIC or v[1] != VERSION:
            raise ProtocolError(f"bad header magic/version {v[0]:#x}/{v[1]} (want {MAGIC:#x}/{VERSION})")
        if v[2] != expect_seq:
            raise ProtocolError(f"message {v[2]} arrived when {expect_seq} was expected")
        try:
            op = Op(v[3])
        except ValueError:
            raise ProtocolError(f"unknown op code {v[3]}") from None
        return Header(v[2], op, tuple(v[4:]))


@dataclass(frozen=True)
class ForwardSizes:
    batch: int
    rows: int  # N new rows per request
    pages: int  # page-table width
    has_mask: bool
    factor: int = 1  # pool pages per table page
    commit_later: bool = False

    @property
    def args(self) -> tuple[int, ...]:
        return (self.batch, self.rows, self.pages, int(self.has_mask), self.factor, int(self.commit_later))

    @staticmethod
    def from_args(args: tuple[int, ...], num_pages: int) -> ForwardSizes:
        b, n, p, mask, f = args[:5]
        later = args[5] if len(args) > 5 else 0  # (a decoded header always has the field)
        _check_factor("FORWARD", f, num_pages)
        _check_sizes("FORWARD", b, n, p, num_pages // f)
        if mask not in (0, 1) or later not in (0, 1):
            raise ProtocolError(f"FORWARD: has_mask and commit_later must be 0 or 1, got {mask}, {later}")
        return ForwardSizes(b, n, p, bool(mask), f, bool(later))

    @property
    def num_ints(self) -> int:
        return 2 * self.batch * self.rows + self.batch * self.pages + self.batch


@dataclass(frozen=True)
class CommitSizes:
    batch: int
    accept: int  # M: accept_idx width
    pages: int
    factor: int = 1  # pool pages per table page

    @property
    def args(self) -> tuple[int, ...]:
        return (self.batch, self.accept, self.pages, self.factor)

    @staticmethod
    def from_args(args: tuple[int, ...], num_pages: int) -> CommitSizes:
        b, m, p, f = args[:4]
        _check_factor("COMMIT", f, num_pages)
        _check_sizes("COMMIT", b, m, p, num_pages // f)
        return CommitSizes(b, m, p, f)

    @property
    def num_ints(self) -> int:
        return self.batch * self.pages + self.batch * self.accept + 2 * self.batch


def move_size(args: tuple[int, ...], num_pages: int) -> int:
    """MOVE's page count K, checked: at most the pool's pages."""
    k = args[0]
    if not 1 <= k <= num_pages:
        raise ProtocolError(f"MOVE: {k} pages is outside [1, {num_pages}]")
    return k


def _check_factor(op: str, factor: int, num_pages: int) -> None:
    if not 1 <= factor <= num_pages:
        raise ProtocolError(f"{op}: coarse factor {factor} is outside [1, {num_pages}]")


def _check_sizes(op: str, batch: int, width: int, pages: int, num_pages: int) -> None:
    if not (1 <= batch and 1 <= width and batch * width <= MAX_ROWS):
        raise ProtocolError(f"{op}: batch {batch} x width {width} is out of range")
    if not 1 <= pages <= num_pages:
        raise ProtocolError(f"{op}: page-table width {pages} is outside [1, {num_pages}]")


def pack(parts, device: torch.device) -> torch.Tensor:
    """Flatten tensors (in the order of the op's schema) into one int64 vector on `device`."""
    return torch.cat([torch.as_tensor(p).reshape(-1).to(device, torch.int64) for p in parts])


def unpack_forward(ints: torch.Tensor, s: ForwardSizes):
    b, n, p = s.batch, s.rows, s.pages
    ids, pos, table, prefix = ints.split([b * n, b * n, b * p, b])
    return ids.view(b, n), pos.view(b, n), table.view(b, p).to(torch.int32), prefix.to(torch.int32)


def unpack_commit(ints: torch.Tensor, s: CommitSizes):
    b, m, p = s.batch, s.accept, s.pages
    table, prefix, accept, rows = ints.split([b * p, b, b * m, b])
    return table.view(b, p).to(torch.int32), prefix, accept.view(b, m), rows


def check_pages(table: torch.Tensor, num_pages: int) -> None:
    """Page ids must be real pages or the pool's padding id (num_pages); host tensors only."""
    if table.device.type == "cpu" and table.numel() and (table.min() < 0 or table.max() > num_pages):
        raise ProtocolError(f"page table holds ids outside [0, {num_pages}]")
