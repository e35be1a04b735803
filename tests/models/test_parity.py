"""treeflash's target equals Hugging Face transformers' DeepseekV3ForCausalLM (fp32)."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from helpers.hf_checkpoints import VARIANTS, make_hf_model, patch_config, write_checkpoint
from treeflash import LLM, SamplingParams
from treeflash.models.layers import set_options
from treeflash.runtime import RuntimeOptions

pytestmark = pytest.mark.slow

TOL = 1e-4  # max relative error (max |diff| / max |ref|), float32


TRITON = RuntimeOptions(fused_kernels="triton")  # the fused path's kernels, through the interpreter


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, 96, (37,), generator=g).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_score_matches_transformers(tmp_path, variant, prompt):
    path = write_checkpoint(tmp_path / variant, **VARIANTS[variant])
    hf = make_hf_model(**VARIANTS[variant])
    llm = LLM(path, device="cpu", dtype="float32", page_size=16)
    assert rel_err(llm.score(prompt, chunk_size=16), hf_logits(hf, prompt)) < TOL


def test_fused_a_projections(tmp_path, prompt):
    """q_lora models load with kv_a / q_a as one GEMM (their Parameters views of one tensor, the
    state dict unchanged) and score as transformers; the runtime option fused_a off loads them apart and
    scores the same; a Parameter replaced after the fusion turns it off for that layer."""
    from treeflash.models.mla import MLA

    path = write_checkpoint(tmp_path / "q_lora", **VARIANTS["q_lora"])
    ref = hf_logits(make_hf_model(**VARIANTS["q_lora"]), prompt)
    llm = LLM(path, device="cpu", dtype="float32", page_size=16)
    attn = [m for m in llm.model.modules() if isinstance(m, MLA)]
    with torch.no_grad():
        assert attn and all(m._a_fused() for m in attn)
    assert not attn[0]._a_fused()  # with grad on, the Parameters' own GEMMs: autograd reaches them
    for m in attn:
        w = m._a_weight
        d = m.kv_a_proj_with_mqa.weight.shape[0]
        assert w.shape == (d + m.cfg.q_lora_rank, m.cfg.hidden_size)
        assert m.kv_a_proj_with_mqa.weight.data_ptr() == w.data_ptr()
        assert m.q_a_proj.weight.data_ptr() == w[d:].data_ptr()
    fused = llm.score(prompt, chunk_size=16)
    assert rel_err(fused, ref) < TOL
    apart = LLM(path, device="cpu", dtype="float32", page_size=16, runtime_options=RuntimeOptions(fused_a=False))
    with torch.no_grad():
        assert not any(m._a_fused() for m in apart.model.modules() if isinstance(m, MLA))
    assert apart.model.state_dict().keys() == llm.model.state_dict().keys()
    for k, v in apart.model.state_dict().items():
        assert torch.equal(v, llm.model.state_dict()[k]), k
    torch.testing.assert_close(apart.score(prompt, chunk_size=16), fused, rtol=1e-5, atol=1e-5)
    # a replaced Parameter: that layer goes back to two GEMMs and uses the new weight
    m = attn[0]
    new = torch.nn.Parameter(m.q_a_proj.weight.detach().clone() * 0.5)
    m.q_a_proj.weight = new
    with torch.no_grad():
        assert not m._a_fused() and all(a._a_fused() for a in attn[1:])
        x = torch.randn(1, 3, m.cfg.hidden_size)
        _, qa = m._a_outputs(x)
        torch.testing.assert_close(qa, torch.nn.functional.linear(x, new))


@pytest.mark.parametrize("variant", ["q_lora", "yarn", "no_interleave"])
def test_fused_norm_rope_score_matches_transformers(tmp_path, variant, prompt):
    """The fused RMSNorm / rotary kernels (what CUDA runs), on CPU through the interpreter."""
    path = write_checkpoint(tmp_path / variant, **VARIANTS[variant])
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, runtime_options=TRITON)
    assert rel_err(llm.score(prompt, chunk_size=16), hf_logits(make_hf_model(**VARIANTS[variant]), prompt)) < TOL


@pytest.mark.parametrize("fused", [None, "triton"])
def test_taps_are_the_layers_outputs(tmp_path, prompt, fused):
    """A layer hands its MLP output to the next layer's input norm unadded (one launch for the
    add and the norm); the taps the engine returns are still transformers' hidden_states[L + 1],
    on the torch ops and the fused kernels (interpreter): the layers' outputs, and for the last
    layer the final normed hidden (transformers stores that one normed; DFlash drafters train
    on it)."""
    from treeflash.engine.request import Request

    path = write_checkpoint(tmp_path / "q_lora", **VARIANTS["q_lora"])
    hf = make_hf_model(**VARIANTS["q_lora"])
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, runtime_options=RuntimeOptions(fused_kernels=fused))
    n = llm.model.cfg.num_hidden_layers
    taps = (n - 1, 0)  # any order, the last layer's output included
    req = Request("taps", prompt, SamplingParams(max_tokens=1))
    llm.pool.grow(req.pages, len(prompt))
    try:
        with torch.no_grad():
            rows = list(llm.engine.prefill_rows(req, prompt, all_logits=True, taps=taps))
    finally:
        llm.pool.release(req.pages)
    got = torch.cat([t for _, t in rows])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True)
    h = llm.model.cfg.hidden_size
    assert got.shape == (len(prompt), 2 * h)
    assert rel_err(got[:, :h], ref.hidden_states[n][0]) < TOL
    assert rel_err(got[:, h:], ref.hidden_states[1][0]) < TOL
    assert rel_err(torch.cat([lg for lg, _ in rows]), ref.logits[0].float()) < TOL


@pytest.mark.parametrize("variant", ["q_lora", "base"])  # with and without q_lora
def test_mla_prep_in_one_launch_scores_as_the_separate_launches(tmp_path, variant, prompt, monkeypatch):
    """On the fused path MLA's kv norm, k_pe rotation, cache store and q_a norm run as one
    `mla_latent_prep` launch: it is used (a spy counts it), scores as transformers, and gives
    the same logits bit for bit as the separate launches (the runtime option mla_prep off)."""
    from treeflash import kernels

    calls = []
    real = kernels.mla_latent_prep
    monkeypatch.setattr(kernels, "mla_latent_prep", lambda *a, **k: calls.append(k.get("qa")) or real(*a, **k))
    path = write_checkpoint(tmp_path / variant, **VARIANTS[variant])
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, runtime_options=TRITON)
    one = llm.score(prompt, chunk_size=16)
    assert calls and all((q is not None) == (variant == "q_lora") for q in calls)
    assert rel_err(one, hf_logits(make_hf_model(**VARIANTS[variant]), prompt)) < TOL
    set_options(llm.model, replace(TRITON, mla_prep=False))
    n = len(calls)
    apart = llm.score(prompt, chunk_size=16)
    assert len(calls) == n and torch.equal(apart, one)


def test_rope_in_absorb_launch_gives_the_rope_launchs_bits(tmp_path, prompt, monkeypatch):
    """In 16-bit on the fused path, calls of <= ROPE_IN_ABSORB_ROWS rows rotate q_pe inside the
    absorb launch (a spy sees `rope=`), wider ones do not, and the logits are bit for bit those
    of the separate rope launch (the runtime option rope_in_absorb off)."""
    from treeflash import kernels
    from treeflash.models import mla

    rows = []
    real = kernels.head_matmul

    def spy(a, *args, rope=None, **kw):
        if rope is not None:
            rows.append(a.shape[0])
        return real(a, *args, rope=rope, **kw)
    monkeypatch.setattr(kernels, "head_matmul", spy)
    path = write_checkpoint(tmp_path / "q_lora", **VARIANTS["q_lora"])
    llm = LLM(path, device="cpu", dtype="bfloat16", page_size=16, runtime_options=TRITON)
    one = llm.score(prompt, chunk_size=16)
    assert rows and max(rows) <= 16 <= mla.ROPE_IN_ABSORB_ROWS
    set_options(llm.model, replace(TRITON, rope_in_absorb=False))
    n = len(rows)
    apart = llm.score(prompt, chunk_size=16)
    assert len(rows) == n and torch.equal(apart, one)
    set_options(llm.model, TRITON)
    assert len(prompt) > mla.ROPE_IN_ABSORB_ROWS
    llm.score(prompt, chunk_size=len(prompt))  # one chunk past the row limit: the rope launch
    assert len(rows) == n


def _llm_on_triton(tmp_path, variant, cls):
    """(LLM of the variant, float32 on CPU, its modules of class cls with impl="triton")."""
    path = write_checkpoint(tmp_path / variant, **VARIANTS[variant])
    llm = LLM(path, device="cpu", dtype="float32", page_size=16)
    mods = [m for m in llm.model.modules() if isinstance(m, cls)]
    assert mods
    for m in mods:
        m.impl = "triton"
    return llm, mods


@pytest.mark.parametrize("variant", ["base", "groups"])
def test_grouped_moe_with_shared_experts_matches_transformers(tmp_path, variant, prompt):
    """What CUDA runs for the MoE layers: the routed and the shared experts in one grouped
    Triton call (interpreter on CPU), against transformers' separate modules."""
    from treeflash.models.moe import MoE

    llm, moes = _llm_on_triton(tmp_path, variant, MoE)
    for m in moes:
        with torch.no_grad():
            assert m._shared_in_call(torch.zeros(1, m.experts_gate.shape[2])) is not None
    assert rel_err(llm.score(prompt, chunk_size=16), hf_logits(make_hf_model(**VARIANTS[variant]), prompt)) < TOL


def test_moe_routing_stats_from_the_routing_launch(tmp_path):
    """On the Triton path (interpreter) a MoE layer's routing statistics come from its routing
    launch: last = tokens per expert of the forward, total = the sum since reset, both equal to
    counting the router's ids."""
    from treeflash.models.moe import MoE

    moe = _llm_on_triton(tmp_path, "groups", MoE)[1][0]
    moe.reset_expert_counts()
    g = torch.Generator().manual_seed(5)
    total = torch.zeros(moe.gate.cfg.n_routed_experts, dtype=torch.long)
    with torch.no_grad():
        for rows in (1, 7):
            x = torch.randn(rows, moe.experts_gate.shape[2], generator=g)
            moe(x)
            want = torch.bincount(moe.gate(x)[1].reshape(-1), minlength=total.numel())
            total += want
            assert torch.equal(moe.last_expert_counts, want) and torch.equal(moe.expert_counts_total, total)



@pytest.mark.parametrize("variant", ["base", "groups"])
def test_split_router_matches_transformers(tmp_path, variant, prompt, monkeypatch):
    """What CUDA runs for a DeepSeek-V3 / Kimi-K2 sized router at decode / verify sizes: the split
    launch (interpreter), put on the small model's routers by lowering the one-program-a-row
    kernel's size limit to 0, against transformers."""
    import treeflash.kernels.moe_router as R
    from treeflash.models.moe import Gate

    monkeypatch.setattr(R, "FUSED_LOGITS_MAX", 0)
    rows, real = [], R.moe_gate_split_triton
    monkeypatch.setattr(R, "moe_gate_split_triton", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    llm, gates = _llm_on_triton(tmp_path, variant, Gate)
    # chunks of 4 rows: a float32 model's router takes the split launch up to 4 rows (float32 FMAs)
    assert rel_err(llm.score(prompt, chunk_size=4), hf_logits(make_hf_model(**VARIANTS[variant]), prompt)) < TOL
    assert len(rows) >= len(gates) and set(rows) <= set(range(1, 5)), rows


@pytest.mark.parametrize("variant", ["base", "yarn", "groups"])
def test_greedy_generation_is_token_identical(tmp_path, variant, prompt):
    path = write_checkpoint(tmp_path / variant, **VARIANTS[variant])
    hf = make_hf_model(**VARIANTS[variant])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt[:9]]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 9:].tolist()
    llm = LLM(path, device="cpu", dtype="float32", page_size=4, prefill_chunk=5)
    out = llm.generate(prompt[:9], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert out.finish_reason == "length"


def test_sharded_checkpoint(tmp_path, prompt):
    path = write_checkpoint(tmp_path / "sharded", shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    llm = LLM(path, device="cpu", dtype="float32")
    assert rel_err(llm.score(prompt), hf_logits(make_hf_model(), prompt)) < TOL


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_routing_matches_transformers_v2_router(tmp_path, method, prompt):
    """transformers' DeepSeek-V2 router (softmax, greedy / group-limited) is the oracle."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    overrides = dict(n_group=4, topk_group=2)
    path = write_checkpoint(tmp_path / method, **overrides)
    patch_config(path, scoring_func="softmax", topk_method=method, norm_topk_prob=False)
    hf = make_hf_model(**overrides)
    for module in hf.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.topk_method = method
            module.forward = types.MethodType(DeepseekV2TopkRouter.forward, module)
    llm = LLM(path, device="cpu", dtype="float32")
    assert rel_err(llm.score(prompt), hf_logits(hf, prompt)) < TOL


def _fp8_checkpoint(tmp_path, block=16):
    """Quantise every 2-D projection of a checkpoint to e4m3 with block scales."""
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    dequant = {}
    for name in list(tensors):
        w = tensors[name]
        if w.dim() != 2 or "embed" in name or "lm_head" in name or "gate.weight" in name:
            continue
        out_f, in_f = w.shape
        scales = torch.empty(-(-out_f // block), -(-in_f // block))
        q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
        deq = torch.empty_like(w)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                s = tile.abs().max().clamp(min=1e-12) / 448.0
                qt = (tile / s).to(torch.float8_e4m3fn)
                q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt
                deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt.float() * s
                scales[i, j] = s
        tensors[name] = q
        tensors[name + "_scale_inv"] = scales
        dequant[name] = deq
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    patch_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                            "weight_block_size": [block, block]})
    return path, dequant


def test_fp8_block_scaled_checkpoint(tmp_path, prompt):
    path, dequant = _fp8_checkpoint(tmp_path)
    hf = make_hf_model()
    sd = hf.state_dict()
    with torch.no_grad():
        for name, w in dequant.items():
            if name in sd:
                sd[name].copy_(w)
            else:  # per-expert names: fold into transformers' fused expert tensors
                layer, e, kind = name.split(".experts.")[0], int(name.split(".")[5]), name.split(".")[6]
                gu, down = sd[f"{layer}.experts.gate_up_proj"], sd[f"{layer}.experts.down_proj"]
                inter = down.shape[-1]
                if kind == "down_proj":
                    down[e].copy_(w)
                else:
                    gu[e, (0 if kind == "gate_proj" else inter):][:inter].copy_(w)
    llm = LLM(path, device="cpu", dtype="float32")
    assert rel_err(llm.score(prompt), hf_logits(hf, prompt)) < TOL


def test_latent_norm_eps_is_the_references(tmp_path, prompt):
    """transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps
    says (Kimi K2.6's says 1e-5) and passes rms_norm_eps to the other norms; so does treeflash.
    The latent projections are scaled down until their mean square is near those epsilons, so
    that the logits match only with the same choice."""
    from treeflash.models.mla import MLA

    over = dict(q_lora_rank=24, rms_norm_eps=1e-5)
    hf = make_hf_model(**over)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_a_proj.weight.mul_(3e-3)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(3e-3)
    hf.save_pretrained(tmp_path / "m")
    llm = LLM(tmp_path / "m", device="cpu", dtype="float32", page_size=16)
    attn = [m for m in llm.model.modules() if isinstance(m, MLA)]
    assert attn and all(m.q_a_layernorm.eps == 1e-6 and m.kv_a_layernorm.eps == 1e-6 for m in attn)
    assert all(layer.input_layernorm.eps == 1e-5 for layer in llm.model.model.layers)
    assert llm.model.model.norm.eps == 1e-5
    assert rel_err(llm.score(prompt, chunk_size=16), hf_logits(hf, prompt)) < TOL
