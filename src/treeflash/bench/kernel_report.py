"""`bench kernel --compile-report`: the portable verify kernels compiled for sm_90 on a machine
without a GPU (registers, stack, shared memory, the hot loop's spills, MMAs, waits and barriers).
`benchmarks/sass_hashes.py` compiles the same tiles (`REPORT_TILES`, `_report_source`)."""

from __future__ import annotations

import itertools
from pathlib import Path

REPORT_TILES = [  # (implementation, block_m, block_n, warps, stages, tma, page_size): the tiles
    # `TILES` runs (kernels/mla_verify/__init__.py), TMA and its pointer fallback, whole and
    # gathered (page 1) tiles
    ("gathered", 64, 64, 8, 2, False, 64), ("gathered", 64, 64, 8, 2, False, 1),
    ("portable", 16, 64, 8, 5, False, 64), ("portable", 16, 64, 8, 5, False, 1),
    ("portable", 64, 32, 8, 5, True, 64), ("portable", 64, 32, 8, 5, False, 64),
    ("portable_tree", 64, 64, 8, 4, True, 64), ("portable_tree", 64, 64, 8, 4, False, 64),
]


def _hot_loop(sass: str) -> dict:
    """The shortest backward-branch loop of `cuobjdump -sass` that holds MMA and async loads
    (the full-tile prefix loop): instructions, spill traffic (LDL / STL), MMA instructions,
    wgmma waits (`WARPGROUP.DEPBAR`: one per MMA means ptxas serialised them) and CTA
    barriers (`BAR.SYNC`)."""
    import re

    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in where:
            continue
        body = [x for _, x in ins[where[int(m.group(1), 16)]:i + 1]]
        mma = sum(("HGMMA" in x) or ("HMMA" in x) for x in body)
        loads = sum(("LDGSTS" in x) or ("UTMALDG" in x) for x in body)
        if mma and loads and (best is None or len(body) < len(best)):
            best = body
    body = best or []
    return {"instructions": len(body), "LDL": sum("LDL" in x for x in body),
            "STL": sum("STL" in x for x in body),
            "mma": sum(("HGMMA" in x) or ("HMMA" in x) for x in body),
            "wgmma_waits": sum("WARPGROUP.DEPBAR" in x for x in body),
            "barriers": sum("BAR.SYNC" in x for x in body)}


def _report_source(impl: str, bm: int, bn: int, tma: bool, page: int, fp8: bool = False):
    """(kernel, signature, constexprs) of one compile-report row (bf16, D 576, v_dim 512; fp8:
    q bf16 over fp8_e4m3 rows, `kvcache.format`)."""
    from treeflash.kernels.mla_verify import gathered, portable

    ints = "s_qb s_qn s_qh s_kp s_ks s_ptb s_tb s_tn s_ob s_on s_oh s_lb s_ln".split()
    half = 256 if impl == "portable_tree" else 512
    kv = "u8" if fp8 else "bf16"
    sig = {"Q": "*bf16", "KV": f"*{kv}"}
    if impl != "gathered":
        sig.update(KVD=f"tensordesc<{kv}[{bn},{half}]>" if tma else f"*{kv}",
                   KRD=f"tensordesc<bf16[{bn},64]>" if tma else f"*{kv}")
    sig.update({"PT": "*i32", "PL": "*i32", "TM": "*bf16", "O": "*bf16", "LSE": "*fp32",
                "PO": "*bf16", "PLSE": "*fp32", "qk_scale": "fp32"})
    sig.update({k: "i32" for k in "H N M v_dim D chunk_max num_splits".split() + ints})
    cx = dict(PAGE_SIZE=page, IS_CAUSAL=True, DIRECT=False, HAS_ROPE=True, BLOCK_M=bm,
              BLOCK_N=bn, BLOCK_V=512, BLOCK_R=64, DOT_PREC="tf32", DOT_F32=False)
    if impl != "gathered":
        cx.update(TILE_PAGES=page % bn == 0, USE_TMA=tma, EVEN_V=True, EVEN_R=True,
                  EVICT="evict_first" if bm == 16 else "")
    if impl == "portable_tree":
        cx.update(BLOCK_T=portable.BLOCK_T)
    cx.update(KV_FP8=fp8)
    fn = {"gathered": gathered._gathered_kernel, "portable": portable._portable_kernel,
          "portable_tree": portable._portable_tree_kernel}
    sig.update({k: "constexpr" for k in cx})
    return fn[impl], sig, cx


def compile_report(args) -> list[dict]:
    """Compile the portable split kernels for sm_90 on this machine (no GPU): registers, stack,
    shared memory, the hot loop's spill traffic, MMA count, wgmma waits and barriers, with
    the launch-time specialisation (pointers and 16-divisible strides marked divisible by
    16). Run with TRITON_INTERPRET=0 under the Triton version of the GPU (the H200 has 3.6:
    ptxas and the generated code differ between versions); D = 576, v_dim = 512, causal,
    bf16, split path; page 64 (whole tiles) unless the row says page 1 (gathered rows); --kv-dtype
    fp8 (or bf16,fp8): the same tiles over fp8_e4m3 rows (`-fp8` rows)."""
    import re
    import subprocess as sp

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    div16 = set("s_qb s_qn s_qh s_kp s_ks v_dim D chunk_max s_ob s_on s_oh".split())
    rows, out_dir = [], Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for (impl, bm, bn, warps, stages, tma, page), kv_dtype in itertools.product(REPORT_TILES, args.kv_dtype):
        fn, sig, cx = _report_source(impl, bm, bn, tma, page, fp8=kv_dtype == "fp8")
        names = list(sig)
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
                 if k not in cx and (sig[k].startswith("*") or k in div16)}
        tag = (f"{impl}-{bm}x{bn}x{warps}x{stages}{'-tma' if tma else ''}"
               f"{'-page' + str(page) if page != 64 else ''}{'-fp8' if kv_dtype == 'fp8' else ''}")
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "num_stages": stages})
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
            rows.append({"tile": tag, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"report {tag}: {rows[-1]['error']}", flush=True)
            continue
        cubin = out_dir / f"report-{tag}.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = sp.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                     text=True).stdout
        sass = sp.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                      text=True).stdout
        cubin.unlink()
        reg = re.search(r"REG:(\d+) STACK:(\d+)", res)
        hot = _hot_loop(sass)
        row = {"tile": tag, "registers": int(reg.group(1)) if reg else None,
               "stack_bytes": int(reg.group(2)) if reg else None, "shared_bytes": k.metadata.shared,
               "hot_loop": hot, "cp_async": sass.count("LDGSTS"), "tma_loads": sass.count("UTMALDG")}
        rows.append(row)
        print(f"report {tag:26s} regs {row['registers']} stack {row['stack_bytes']:4d} smem "
              f"{row['shared_bytes']:6d} | hot loop {hot['instructions']:4d} instr, LDL "
              f"{hot['LDL']:3d} STL {hot['STL']:3d} mma {hot['mma']:3d} wgmma waits "
              f"{hot['wgmma_waits']:3d} barriers {hot['barriers']:2d}", flush=True)
    return rows
