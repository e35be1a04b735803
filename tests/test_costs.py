"""costs/: the floors of bench/floors.py as they were (numbers recorded from commit c02d190's
floors.step_floor and speculative/budget.py FloorCost), the closed-form parts equal to the per-layer
walk, expert bytes from the stored format (INT4: 0.5625 B a parameter), distinct experts as
DESIGN.md tabulates them, monotone in rows and context, and the online fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treeflash import costs
from treeflash.bench.presets import build_preset
from treeflash.costs import Ceilings, ModelCosts, StepCostModel, StepShape

C = Ceilings(4.24e12, 779e12, "test")


@pytest.fixture(scope="module")
def tiny():
    model, drafter, _ = build_preset("tiny", torch.device("cpu"), torch.float32)
    return model, drafter


# recorded from the floor model before it moved (bench/floors.py, speculative/budget.py at c02d190)
OLD_STEP = {  # (context, rows, touched) -> (attention, target_weights, drafter, step) seconds
    (1000, 33, 3.0): (1.1320754716981133e-07, 1.2235471698113207e-07, 1.4369811320754717e-07,
                      3.7926037735849056e-07),
    (4096, 8, None): (4.6369811320754715e-07, 1.7880754716981133e-07, 3.3062641509433963e-07,
                      9.73132075471698e-07),
    (1, 1, None): (1.1320754716981132e-10, 1.7838490566037737e-07, 0.0, 1.784981132075472e-07),
}
OLD_BATCH = {  # (budget, contexts) -> FloorCost seconds
    (7, (256,)): 2.9728160377358494e-07, (15, (1024, 3072)): 1.057892570872398e-06,
    (31, (512,) * 8): 1.5713509433962263e-06, (63, (1024, 3072)): 1.1814952913992297e-06,
    (127, (512,) * 8): 2.37997679695788e-06,
}


@pytest.mark.parametrize("key", list(OLD_STEP))
def test_step_floor_reproduces_the_old_floors(tiny, key):
    model, drafter = tiny
    context, rows, touched = key
    f = costs.step_floor(model, drafter, C, context, rows, 2.0, touched)
    got = (f["attention"]["s"], f["target_weights"]["s"], f["drafter"]["s"], f["step_s"])
    assert got == pytest.approx(OLD_STEP[key], rel=1e-12)
    plan = costs.step_floor(model, drafter, C, 1000, 33, 2.0, 3.0, costs.LayerPlan(61, 1))["step_s"]
    assert plan == pytest.approx(4.866928301886792e-06, rel=1e-12)


@pytest.mark.parametrize("key", list(OLD_BATCH))
def test_closed_form_parts_reproduce_the_old_batch_floor(tiny, key):
    """ModelCosts (sizes walked once) = the old per-step walk over every layer, for batches."""
    model, drafter = tiny
    budget, contexts = key
    mc = ModelCosts.of(model, drafter)
    assert mc.floor_s(C, budget + 1, contexts) == pytest.approx(OLD_BATCH[key], rel=1e-12)


def test_closed_form_parts_equal_step_floor(tiny):
    model, drafter = tiny
    mc = ModelCosts.of(model, drafter)
    for context, rows in ((1, 1), (300, 8), (5000, 64)):
        want = costs.step_floor(model, drafter, C, context, rows, 0.0, None)
        parts = mc.parts(rows, [context], touched=lambda r, m: m.local)  # all experts, as touched=None
        for name, p in parts.items():
            assert C.floor_s(p.bytes, p.flops) == pytest.approx(want[name]["s"], rel=1e-12), (name, rows)


def test_distinct_experts_as_design_tabulates():
    """Kimi K2, E = 384, k = 8 (DESIGN.md): T = 1: 8, 8: 60, 16: 110, 32: 187."""
    got = [costs.distinct_experts(t, 8, 384) for t in (1, 8, 16, 32)]
    assert got == pytest.approx([8, 60, 110, 187], abs=1.3)  # (DESIGN.md rounds 59.5, 109.8, 188.2)
    assert costs.distinct_experts(0, 8, 384) == 0 and costs.distinct_experts(10**6, 8, 384) == pytest.approx(384)


def test_expert_bytes_come_from_the_stored_format():
    """bf16 stacks: 2 B a parameter; an INT4 stack (compressed-tensors pack-quantized, group 32,
    bf16 scales) behind a routed_weights() accessor: 0.5625 B a parameter, with no change here."""
    from treeflash.kernels.int4 import quantize_int4

    e, inter, hidden = 4, 64, 128
    w = [torch.randn(e, inter, hidden), torch.randn(e, inter, hidden), torch.randn(e, hidden, inter)]

    class Bf16:
        experts_gate, experts_up, experts_down = (t.to(torch.bfloat16) for t in w)

    class Int4:
        def routed_weights(self):
            return tuple(quantize_int4(t) for t in w)

    params = 3 * inter * hidden
    assert costs.expert_sizes(Bf16()) == (e, 2.0 * params, params)
    local, nbytes, p = costs.expert_sizes(Int4())
    assert (local, p) == (e, params) and nbytes / p == pytest.approx(0.5625)
    assert costs.is_moe(Int4()) and costs.is_moe(Bf16())


def test_cost_grows_with_rows_and_context_and_tiles(tiny):
    model, drafter = tiny
    mc = ModelCosts.of(model, drafter)
    by_rows = [mc.floor_s(C, r, [4096], tiles=True) for r in (1, 2, 4, 8, 16, 32, 64)]
    assert by_rows == sorted(by_rows) and by_rows[0] < by_rows[-1]
    by_ctx = [mc.floor_s(C, 16, [c]) for c in (1, 1024, 8192, 65536)]
    assert by_ctx == sorted(by_ctx) and by_ctx[0] < by_ctx[-1]
    by_batch = [mc.floor_s(C, 8, [1024] * n) for n in (1, 2, 8, 32)]
    assert by_batch == sorted(by_batch)
    # 4 heads: 16 rows a request fill one 64-row tile; 17 rows pay a second one
    assert mc.tile_rows(16) == 16 and mc.tile_rows(17) == 32 and mc.tile_rows(1) == 16
    fl = mc.parts(17, [8192], tiles=True)["attention"].flops
    assert fl == pytest.approx(mc.parts(32, [8192])["attention"].flops)


def _shape(budget, n=1, ctx=1024):
    return StepShape((), (ctx,) * n, budget) if budget else StepShape((ctx,) * n, (), 0)


def test_fit_recovers_fixed_costs_and_the_floor_slope(tiny):
    """Steps measured as F_kind + 1.7 x floor (budgets 1-63, two contexts): F and rho come back,
    and an unmeasured shape (batch 4) is predicted from them."""
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), Ceilings(1e9, 1e11, "slow"))

    def truth(shape):
        return (2e-3 if shape.plain else 0) + (5e-3 if shape.spec else 0) + 1.7 * m.floor_parts_s(shape)
    for _ in range(3):
        for b in (0, 1, 3, 7, 15, 31, 63):
            for ctx in (512, 8192):
                m.observe(_shape(b, ctx=ctx), truth(_shape(b, ctx=ctx)))
    f_p, f_s, rho = m.theta
    assert (f_p, f_s, rho) == pytest.approx((2e-3, 5e-3, 1.7), rel=0.03)  # (the prior rho ~ 1 pulls a little)
    for shape in (_shape(15, n=4), _shape(0, n=4), StepShape((100,), (200, 300), 7)):
        assert m.predict(shape) == pytest.approx(truth(shape), rel=0.02)


def test_launch_bound_steps_keep_rho_one_and_a_plain_step_costs_the_tree_steps_fixed_part(tiny):
    """Steps 100x their floor (a tiny model, launch-bound): rho stays ~1 (the floor barely moves
    the fit), so every budget costs about the same; with no plain step measured, a plain step
    is priced with the speculative steps' fixed part, not at its floor alone."""
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), C)
    for _ in range(4):
        for b in (3, 7):
            m.observe(_shape(b), 1e-3)
    f_p, f_s, rho = m.theta
    assert rho == pytest.approx(1.0, abs=0.05) and f_s == pytest.approx(1e-3, rel=0.01)
    assert f_p == pytest.approx(f_s, rel=0.05)
    assert m.predict(_shape(63)) == pytest.approx(1e-3, rel=0.05)
    assert m.predict(_shape(0)) > 0.9e-3


def test_first_step_of_a_budget_is_no_sample_and_residuals_correct_a_budget(tiny):
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), C)
    m.observe(_shape(7), 5.0)  # a capture-laden first step: ignored
    assert not m.samples and not m.priced(7)
    for _ in range(5):
        m.observe(_shape(7), 1e-3)
        m.observe(_shape(15), 1e-3)
        m.observe(_shape(31), 2e-3)  # one tile too many: dearer than the fit of the others
    assert m.priced(31) and m.predict(_shape(31)) == pytest.approx(2e-3, rel=0.02)
    assert m.predict(_shape(7)) == pytest.approx(1e-3, rel=0.02)
    # an unpriced budget is never cheaper than a smaller priced one
    assert m.predict(_shape(63)) >= m.predict(_shape(31)) * (1 - 1e-12)


def test_a_budgets_residual_forgets_samples_of_another_context(tiny):
    """A launch-bound budget measured dear at 1k (its kernels' worst case there) and cheap at
    32k: at 32k it is priced by the 32k samples alone, not the median of both contexts'."""
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), C)
    for _ in range(6):
        m.observe(_shape(7, ctx=1024), 1e-3)
        m.observe(_shape(3, ctx=1024), 1.4e-3)
    for _ in range(2):
        m.observe(_shape(7, ctx=32768), 1e-3)
        m.observe(_shape(3, ctx=32768), 0.9e-3)
    assert m.predict(_shape(3, ctx=32768)) < m.predict(_shape(7, ctx=32768))


def test_a_step_far_over_its_budgets_recent_steps_prices_nothing_unless_it_persists(tiny):
    """One step 300x its budget's others (a compile inside it) leaves the fit and the budget's
    price alone; the same cost three times in a row is a new regime, priced from then on."""
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), C)
    for _ in range(6):
        m.observe(_shape(7), 5e-3)
        m.observe(_shape(3), 4e-3)
    before = (*m.theta, m.predict(_shape(7)), m.predict(_shape(3)))
    m.observe(_shape(7), 1.5)
    assert (*m.theta, m.predict(_shape(7)), m.predict(_shape(3))) == pytest.approx(before)
    for _ in range(3):
        m.observe(_shape(7), 0.03)
    assert m.predict(_shape(7)) == pytest.approx(0.03, rel=0.05)


def test_measured_experts_replace_uniform_routing(tiny):
    model, drafter = tiny
    mc = ModelCosts.of(model, drafter)
    m = StepCostModel(mc, C)
    before = m.floor_parts_s(_shape(15))
    sizes = mc.moe_sizes
    uniform = [costs.distinct_experts(16, s.k, s.experts) for s in sizes]
    m.observe_touch(16, [u / 2 for u in uniform])  # routing concentrated: half the experts
    assert m.touch.ratio(16) == pytest.approx(0.5) and m.touch.ratio(1000) == pytest.approx(0.5)
    assert m.floor_parts_s(_shape(15)) < before


def test_a_tree_step_is_never_priced_below_the_plain_step_it_contains(tiny):
    """Noise on a shared machine measured trees cheaper than plain steps: not believed (a step
    with a tree runs the same forward with more rows, and the drafter)."""
    model, drafter = tiny
    m = StepCostModel(ModelCosts.of(model, drafter), C)
    for _ in range(6):
        m.observe(_shape(0), 2e-3)
        m.observe(_shape(7), 1e-3)
        m.observe(_shape(3), 1.5e-3)
    assert m.predict(_shape(7)) >= m.predict(_shape(0)) * (1 - 1e-12)
    assert m.predict(_shape(7)) >= m.predict(_shape(3)) * (1 - 1e-12)


@pytest.mark.slow
def test_the_serving_path_never_imports_the_benchmarks():
    """costs/ sits below engine/ and speculative/; the auto budget prices steps without bench/."""
    import subprocess
    import sys

    code = ("import sys; import treeflash.costs, treeflash.speculative.decoder, treeflash.engine.llm, "
            "treeflash.server.metrics; bad = sorted(m for m in sys.modules if m.startswith('treeflash.bench')); "
            "print(bad); raise SystemExit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for src in Path(costs.__file__).parent.glob("*.py"):
        text = src.read_text()
        assert "treeflash.bench" not in text and "treeflash.engine" not in text and "treeflash.server" not in text


def test_a_k26_checkpoints_int4_experts_are_costed_as_stored(tmp_path):
    """A Kimi K2.6-layout checkpoint (routed experts compressed-tensors INT4, group 32, bf16
    scales) loaded by the engine: its MoE layers' experts weigh 0.5625 B a parameter in the
    floor and in the sizing's sizes, everything else as stored."""
    from helpers.k26_checkpoints import write_k26_checkpoint
    from treeflash.models.loader import load_target

    model = load_target(write_k26_checkpoint(tmp_path / "k26"), torch.device("cpu"), torch.bfloat16)
    mc = ModelCosts.of(model)
    assert mc.moe and all(m.expert_bytes / m.expert_params == pytest.approx(0.5625) for m, _ in mc.moe)
    moe_layer = next(layer for layer in model.model.layers if costs.is_moe(layer.mlp))
    local, nbytes, params = costs.expert_sizes(moe_layer.mlp)
    part = costs.layer_weight_part(moe_layer, 1, 1.0)
    assert nbytes / params == pytest.approx(0.5625) and part.bytes > nbytes
