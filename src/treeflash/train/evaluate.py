"""Evaluate a trained target + drafter pair on held-out files (reference HF/dflash models).

- target: held-out loss/perplexity (also by position, past the 8k training context with
  YaRN), and how often greedy completions of held-out function headers are valid Python;
- drafter: mean acceptance length (commit length per step, bonus included) in chain mode
  and with DDTree trees, at T=0 and T=1, and against context length.

Acceptance is computed from a reference continuation, which is exact for lossless
verification: with a chain of greedy drafts or a DDTree tree, the committed text IS a
target continuation (greedy at T=0, a target sample at T=1), and one step's draft depends
only on the committed prefix. So we generate the continuation once, run the target over
it once for the taps, run the drafter once for every possible anchor, and walk. A step
at anchor a accepts the longest path of drafts equal to continuation[a+1:] (chain: the
argmax path; DDTree: any root path of the tree built from the drafter's per-slot
log-probabilities). `dflash_generate` (the z-lab loop) cross-checks the chain numbers.
"""

from __future__ import annotations

import ast
import heapq
import json
import math
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .corpus import TokenData, fixed_windows
from .drafter import draft_logits, load_drafter, target_features
from .loop import check_seq_len, resolve_device
from .target import check_data_matches_target, lm_loss, load_target
from .tokenizer import load_tokenizer, special_ids

# ---- target quality --------------------------------------------------------------------


@torch.no_grad()
def loss_by_position(target, stream: np.ndarray, length: int, count: int, edges: list[int], device) -> dict:
    """Mean next-token loss over fixed held-out windows of `length`, split at `edges`."""
    windows = fixed_windows(stream, count, length + 1)
    sums = np.zeros(len(edges) + 1)
    counts = np.zeros(len(edges) + 1)
    bounds = [0, *edges, length]
    for w in windows:
        batch = torch.from_numpy(w[None]).to(device)
        logits = target(input_ids=batch[:, :-1], use_cache=False).logits.float()
        ce = F.cross_entropy(logits[0], batch[0, 1:], reduction="none").cpu().numpy()
        for i in range(len(bounds) - 1):
            seg = ce[bounds[i] : bounds[i + 1]]
            sums[i] += seg.sum()
            counts[i] += len(seg)
    out = {}
    for i in range(len(bounds) - 1):
        if counts[i]:
            loss = sums[i] / counts[i]
            out[f"{bounds[i]}-{bounds[i + 1]}"] = {"loss": round(loss, 4), "ppl": round(math.exp(loss), 3)}
    return out


@dataclass(frozen=True)
class FunctionPrompt:
    relpath: str
    lineno: int
    header: str  # the `def ...:` line as in the file (with its indentation)
    ids: list[int]  # prompt tokens, ending at the header's colon


def function_prompts(
    heldout_files: list[dict], tok, prompt_len: int, count: int, per_file: int = 2
) -> list[FunctionPrompt]:
    """Held-out function headers with at least `prompt_len` tokens of file before them."""
    out: list[FunctionPrompt] = []
    for f in sorted(heldout_files, key=lambda f: f["relpath"]):
        try:
            tree = ast.parse(f["text"])
        except (SyntaxError, ValueError):
            continue
        lines = f["text"].split("\n")
        taken = 0
        for node in ast.walk(tree):
            if taken >= per_file or len(out) >= count:
                break
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            header = lines[node.lineno - 1]
            if node.body[0].lineno <= node.lineno or not header.rstrip().endswith(":") or "#" in header:
                continue
            text = "\n".join(lines[: node.lineno - 1] + [header.rstrip()])
            ids = tok.encode(text).ids
            if len(ids) < prompt_len:
                continue
            out.append(FunctionPrompt(f["relpath"], node.lineno, header.rstrip(), ids[-prompt_len:]))
            taken += 1
        if len(out) >= count:
            break
    return out


_INCOMPLETE = ("was never closed", "unexpected EOF", "expected an indented block", "unterminated triple",
               "expected 'except' or 'finally' block", "EOF while scanning")


def _prefix_ok(src: str) -> bool:
    """Valid Python, or a valid prefix of it (open brackets/blocks at the end)."""
    try:
        ast.parse(src)
        return True
    except SyntaxError as e:
        if any(s in str(e.msg) for s in _INCOMPLETE):
            return True
    last = [ln for ln in src.split("\n") if ln.strip()][-1]
    pad = " " * (len(last) - len(last.lstrip()) + 4)
    try:
        ast.parse(src + "\n" + pad + "pass")
        return True
    except SyntaxError:
        return False


def function_body(header: str, completion: str) -> tuple[list[str], bool]:
    """Lines of the generated body up to the function's end; closed=True if it ended by dedent."""
    indent = len(header) - len(header.lstrip())
    lines = completion.split("\n")
    if lines and lines[0].strip() == "":
        lines = lines[1:]  # the header's own line break
    body: list[str] = []
    for ln in lines:
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent and body:
            return body, True
        body.append(ln)
    return body[:-1], False  # the last line may be cut mid-way


def python_validity(samples: list[tuple[str, str]]) -> dict:
    """Share of completed functions that parse, and of generated lines that keep the code valid."""
    parsed = lines_ok = lines_total = n = 0
    for header, completion in samples:
        body, _closed = function_body(header, completion)
        body = [ln for ln in body if ln.strip()]
        if not body:
            continue
        n += 1
        src = textwrap.dedent("\n".join([header, *body]))
        try:
            ast.parse(src)
            parsed += 1
        except SyntaxError:
            pass
        for i in range(1, len(body) + 1):
            lines_total += 1
            lines_ok += _prefix_ok(textwrap.dedent("\n".join([header, *body[:i]])))
    return {"functions": n, "function_parse_rate": round(parsed / max(1, n), 4),
            "valid_line_share": round(lines_ok / max(1, lines_total), 4), "lines": lines_total}


@torch.no_grad()
def continue_tokens(target, prompts: torch.Tensor, n: int, temperature: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Continue [b, P] prompts by n tokens (greedy at T=0, else sampled); returns [b, P+n]."""
    from transformers import DynamicCache

    gen = torch.Generator(device=prompts.device).manual_seed(seed)
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1]
    out = [prompts]
    for _ in range(n):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        logits = target(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, 1)


# ---- acceptance ----------------------------------------------------------------------------


def ddtree_children(logp: np.ndarray | torch.Tensor, budget: int) -> list[dict[int, int]]:
    """DDTree best-first tree from per-depth log-probs [D, V]; returns child maps (node 0 = root)."""
    lp = torch.as_tensor(logp)
    vals, toks = lp.topk(min(budget, lp.shape[-1]), dim=-1)
    return ddtree_from_topk(vals.tolist(), toks.tolist(), budget)


def ddtree_from_topk(vals: list[list[float]], toks: list[list[int]], budget: int) -> list[dict[int, int]]:
    """The DDTree heap (reference section 2.1) over per-depth top-k lists sorted descending."""
    topk, depth_n = len(vals[0]), len(vals)
    children: list[dict[int, int]] = [{}]
    heap = [(-vals[0][0], 0, 0, 0, 0)]  # (-score, tiebreak, depth, rank, parent)
    tie = 1
    while heap and len(children) - 1 < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        s = -neg
        node = len(children)
        children.append({})
        children[parent][toks[d][r]] = node
        if r + 1 < topk:
            heapq.heappush(heap, (-(s - vals[d][r] + vals[d][r + 1]), tie, d, r + 1, parent))
            tie += 1
        if d + 1 < depth_n:
            heapq.heappush(heap, (-(s + vals[d + 1][0]), tie, d + 1, 0, node))
            tie += 1
    return children


def walk_tree(children: list[dict[int, int]], reference: list[int]) -> int:
    """Drafts accepted when the target's tokens are `reference` (continuation after the root)."""
    cur, acc = 0, 0
    for tok in reference:
        nxt = children[cur].get(tok)
        if nxt is None:
            break
        cur, acc = nxt, acc + 1
    return acc


def walk_chain(drafts: list[int], reference: list[int]) -> int:
    acc = 0
    for d, r in zip(drafts, reference):
        if d != r:
            break
        acc += 1
    return acc


@torch.no_grad()
def simulate_acceptance(target, drafter, seqs: torch.Tensor, start: int, budgets: list[int]) -> dict:
    """Per-step acceptance lengths of chain and DDTree decoding that commits `seqs[:, start:]`.

    `seqs[:, start]` is the first bonus token (the target's token after the prompt).
    """
    b, total = seqs.shape
    bs = drafter.block_size
    last = total - bs  # last anchor with a full block of reference tokens after it
    if last < start:
        raise ValueError(f"continuation too short: need > {bs} tokens after the prompt")
    taps, _ = target_features(target, seqs, drafter.target_layer_ids)
    anchors = torch.arange(start, last + 1, device=seqs.device)[None].expand(b, -1).contiguous()
    logp = torch.log_softmax(draft_logits(drafter, target, taps, seqs, anchors).float(), -1)  # [b, N, B-1, V]
    drafts = logp.argmax(-1).cpu()
    kmax = max(budgets) if budgets else 1
    top_vals, top_toks = logp.topk(min(kmax, logp.shape[-1]), dim=-1)
    top_vals, top_toks = top_vals.cpu(), top_toks.cpu()
    seq_list = seqs.cpu().tolist()
    result: dict[str, list[int]] = {"chain": []}
    for row in range(b):
        a = start
        while a <= last:
            acc = walk_chain(drafts[row, a - start].tolist(), seq_list[row][a + 1 : a + bs])
            result["chain"].append(acc + 1)
            a += acc + 1
    for budget in budgets:
        key = f"ddtree_b{budget}"
        result[key] = []
        for row in range(b):
            a = start
            while a <= last:
                tree = ddtree_from_topk(top_vals[row, a - start, :, :budget].tolist(),
                                        top_toks[row, a - start, :, :budget].tolist(), budget)
                acc = walk_tree(tree, seq_list[row][a + 1 : a + bs])
                result[key].append(acc + 1)
                a += acc + 1
    return result


def summarize(lengths: dict[str, list[int]]) -> dict:
    return {
        k: {"mean_acceptance_length": round(float(np.mean(v)), 3), "steps": len(v)} for k, v in lengths.items() if v
    }


@torch.no_grad()
def reference_check(target, drafter, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int = 0) -> dict:
    """Acceptance lengths from the z-lab `dflash_generate` loop, one prompt at a time.

    At T>0 the reference samples drafts from the drafter and rejection-samples them.
    """
    from dflash import model as dm

    torch.manual_seed(seed)
    lengths, outputs = [], []
    orig = dm._cuda_time
    if not prompts.is_cuda:
        dm._cuda_time = time.perf_counter  # the reference syncs CUDA for its timers
    try:
        for p in prompts:
            res = dm.dflash_generate(drafter, target, p[None], new_tokens, None, temperature=temperature,
                                     return_stats=True)
            lengths.extend(int(x) for x in res.acceptance_lengths)
            outputs.append(res.output_ids[0].tolist())
    finally:
        dm._cuda_time = orig
    return {"mean_acceptance_length": round(float(np.mean(lengths)), 3), "steps": len(lengths),
            "outputs": outputs, "lengths": lengths}


# ---- the whole evaluation ------------------------------------------------------------------


# The acceptance sweep's contexts when --context-lengths is not given; one that the target's
# positions cannot hold (with the tokens generated after it) becomes the longest that fits.
DEFAULT_CONTEXTS = (1024, 4096, 8192, 16384, 32768)


@dataclass
class EvalArgs:
    data: str
    target: str
    drafter: str | None
    out: str
    prompts: int = 48
    prompt_len: int = 512
    new_tokens: int = 128
    loss_windows: int = 16
    seq_len: int = 8192
    long_len: int = 32768
    long_windows: int = 2
    context_lengths: tuple[int, ...] | None = None  # None: DEFAULT_CONTEXTS as far as the target reaches
    context_prompts: int = 4
    context_new_tokens: int = 64
    budgets: tuple[int, ...] = (16, 32)
    reference_prompts: int = 4
    device: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        for name in ("prompts", "prompt_len", "new_tokens", "loss_windows", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if any(b <= 0 for b in self.budgets):
            raise ValueError(f"--budgets must be positive, got {self.budgets}")
        if self.long_len < 0:
            raise ValueError(f"--long-len must be >= 0 (0 skips the loss by position), got {self.long_len}")
        if self.context_lengths is not None and any(c <= 0 for c in self.context_lengths):
            raise ValueError(f"--context-lengths must be positive, got {self.context_lengths}")

    def check_positions(self, max_positions: int, block: int | None) -> None:
        """Every position a part of the evaluation runs the target at must exist in it (past
        max_position_embeddings RoPE/YaRN runs on positions it was never built for, with no
        error, and the numbers mean nothing). block: the drafter's block size, or None. Checked
        before any part runs, not when the one that overflows is reached."""
        whose = f"--target {self.target}'s max_position_embeddings {max_positions}"
        check_seq_len(self.seq_len, max_positions, f"--target {self.target}'s")
        if self.long_len > self.seq_len and self.long_len > max_positions:
            raise ValueError(f"--long-len {self.long_len} is more than {whose}: pass --long-len "
                             f"{max_positions} or less (0 skips the loss by position)")
        extra = 16 if block is None else block  # generated past --new-tokens for the acceptance check
        need = self.prompt_len + self.new_tokens + extra
        if need > max_positions:
            raise ValueError(f"--prompt-len {self.prompt_len} + --new-tokens {self.new_tokens} + {extra} "
                             f"({'the draft block' if block else 'a margin'}) = {need} positions, more than "
                             f"{whose}: lower --prompt-len or --new-tokens")
        if block is not None and self.context_lengths is None:
            room = max_positions - self.context_new_tokens - block
            self.context_lengths = tuple(sorted({min(c, room) for c in DEFAULT_CONTEXTS if room > 0}))
        elif block is not None:
            longest = max(self.context_lengths, default=0)
            need = longest + self.context_new_tokens + block
            if need > max_positions:
                raise ValueError(f"--context-lengths {longest} + {self.context_new_tokens} new tokens + {block} "
                                 f"(the draft block) = {need} positions, more than {whose}: drop the "
                                 f"context lengths above {max_positions - self.context_new_tokens - block}")


def prepare_out_file(out: str | Path) -> Path:
    """Create the folder of the --out JSON and check that it can be written there now, before
    the models load, not after the whole evaluation ran."""
    p = Path(out)
    if p.is_dir():
        raise ValueError(f"--out {out}: is a folder, expected the path of a JSON file to write")
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:  # mkdir would say only "File exists"
        raise ValueError(f"--out {out}: cannot write there ({blocker} is a file, not a folder)")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p.parent):
            pass
        if p.exists():
            open(p, "a").close()  # an existing file must be writable too; appending nothing changes nothing
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return p


def _file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.suffix in (".safetensors", ".json"))


def evaluate(args: EvalArgs, log=print) -> dict:
    args.validate()
    out = prepare_out_file(args.out)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    data = TokenData.load(args.data)
    tok = load_tokenizer(data.tokenizer_path)
    eos = special_ids(tok).eos
    target = load_target(args.target, device, torch.float32)
    check_data_matches_target(data, args.target, target.config.vocab_size)
    block = None if args.drafter is None else load_drafter(args.drafter).block_size
    args.check_positions(target.config.max_position_embeddings, block)
    t0 = time.time()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    metrics: dict = {"device": str(device), "gpu": gpu}
    loss = lm_loss_windows(target, data.heldout, args.seq_len, args.loss_windows, device)
    metrics["target"] = {"parameters": sum(p.numel() for p in target.parameters()),
                         "files_bytes": _file_bytes(Path(args.target)),
                         "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3),
                         "heldout_tokens": args.loss_windows * args.seq_len}
    if args.long_len > args.seq_len and len(data.heldout) > args.long_len + 1:
        metrics["target"]["loss_by_position"] = loss_by_position(
            target, data.heldout, args.long_len, args.long_windows, [1024, 4096, 8192, 16384], device)
    log(f"target loss {metrics['target']} ({time.time() - t0:.0f}s)")
    files = [json.loads(ln) for ln in (data.dir / "data" / "heldout_files.jsonl").read_text().splitlines()]
    prompts = function_prompts(files, tok, args.prompt_len, args.prompts)
    if not prompts:
        raise ValueError(f"no held-out function header has {args.prompt_len} tokens before it; lower --prompt-len")
    ids = torch.tensor([p.ids for p in prompts], device=device)
    extra = 16 if block is None else block
    greedy = continue_tokens(target, ids, args.new_tokens + extra)
    samples = []
    for p, row in zip(prompts, greedy[:, args.prompt_len :].tolist()):
        row = row[: args.new_tokens]
        if eos in row:
            row = row[: row.index(eos)]
        samples.append((p.header, tok.decode(row)))
    metrics["target"]["valid_python"] = {**python_validity(samples), "prompt_tokens": args.prompt_len,
                                         "new_tokens": args.new_tokens}
    metrics["examples"] = [{"file": p.relpath, "line": p.lineno, "header": p.header, "completion": c}
                           for p, (_, c) in list(zip(prompts, samples))[:6]]
    # a few fixed held-out prompts (text) for acceptance tests that must not need the corpus
    metrics["fixed_prompts"] = [{"file": p.relpath, "line": p.lineno, "text": tok.decode(p.ids[-256:])}
                                for p in prompts[:8]]
    log(f"valid python {metrics['target']['valid_python']} ({time.time() - t0:.0f}s)")
    if args.drafter is not None:
        metrics["drafter"] = _drafter_metrics(args, target, ids, greedy, data, device, log, t0)
    metrics["eval_seconds"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def lm_loss_windows(target, stream, seq_len, count, device) -> float:
    windows = fixed_windows(stream, count, seq_len + 1)
    with torch.no_grad():
        return float(np.mean([float(lm_loss(target, torch.from_numpy(w[None]).to(device), device)) for w in windows]))


def _drafter_metrics(args, target, ids, greedy, data, device, log, t0) -> dict:
    drafter = load_drafter(args.drafter, device, torch.float32)
    budgets = list(args.budgets)
    start = args.prompt_len
    out: dict = {"parameters": sum(p.numel() for p in drafter.parameters()),
                 "files_bytes": _file_bytes(Path(args.drafter)), "block_size": drafter.block_size,
                 "target_layer_ids": list(drafter.target_layer_ids), "prompts": len(ids)}
    out["T0"] = summarize(simulate_acceptance(target, drafter, greedy, start, budgets))
    sampled = continue_tokens(target, ids, args.new_tokens + drafter.block_size, temperature=1.0, seed=args.seed)
    out["T1"] = summarize(simulate_acceptance(target, drafter, sampled, start, budgets))
    log(f"acceptance T0 {out['T0']} T1 {out['T1']} ({time.time() - t0:.0f}s)")
    n_ref = min(args.reference_prompts, len(ids))
    if n_ref:
        ref = reference_check(target, drafter, ids[:n_ref], args.new_tokens, 0.0)
        sim = simulate_acceptance(target, drafter, greedy[:n_ref], start, [])["chain"]
        same_text = all(o[: start + args.new_tokens] == g[: start + args.new_tokens]
                        for o, g in zip(ref.pop("outputs"), greedy[:n_ref].tolist()))
        out["dflash_reference_T0"] = {**{k: v for k, v in ref.items() if k != "lengths"},
                                      "same_text_as_greedy": same_text,
                                      "simulated_chain_mean_same_prompts": round(float(np.mean(sim)), 3)}
        ref1 = reference_check(target, drafter, ids[:n_ref], args.new_tokens, 1.0, seed=args.seed)
        ref1.pop("outputs")
        out["dflash_reference_T1_sampled_drafts"] = {k: v for k, v in ref1.items() if k != "lengths"}
        log(f"dflash reference {out['dflash_reference_T0']} ({time.time() - t0:.0f}s)")
    out["by_context"] = _context_sweep(args, target, drafter, data, device, budgets)
    log(f"by context {out['by_context']} ({time.time() - t0:.0f}s)")
    return out


def _context_sweep(args, target, drafter, data, device, budgets) -> list[dict]:
    rows = []
    for length in args.context_lengths:
        if len(data.heldout) < length * args.context_prompts // 2 + length:
            continue
        windows = fixed_windows(data.heldout, args.context_prompts, length)
        ids = torch.from_numpy(windows).to(device)
        seqs = continue_tokens(target, ids, args.context_new_tokens + drafter.block_size)
        res = summarize(simulate_acceptance(target, drafter, seqs, length, budgets))
        rows.append({"context": length, **{k: v["mean_acceptance_length"] for k, v in res.items()}})
    return rows
