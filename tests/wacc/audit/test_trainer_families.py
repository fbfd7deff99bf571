"""transformers.Trainer over more model families (three more causal LMs, a masked LM, a seq2seq
model), each built from a tiny config, on its family's microbatches and against its own float64
truth (needs the `frameworks` extra)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.expected import (  # noqa: E402
    assert_mean_weighted_error,
    assert_rel_l2_matches,
    mean_weighted_terms,
    prediction_bound,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.models import (  # noqa: E402
    FAMILIES,
    MASK_TOKEN,
    MODEL_KINDS,
    PAD_TOKEN,
    shift_right,
)
from wacc.audit.runner import AuditResult, Cell, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import IGNORE_INDEX, WINDOW_NAMES, build_window  # noqa: E402

CAUSAL = ("trainer-qwen2", "trainer-gpt_neox", "trainer-opt")
MEAN_LOSS = ("trainer-bert", "trainer-t5")  # forward takes **kwargs, loss ignores the count
WINDOWS = ("unequal", "equal")
NEW_KINDS = ("qwen2", "gpt_neox", "opt", "bert", "t5")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("window", WINDOW_NAMES)
def test_families_keep_the_window_counts(family: str, window: str) -> None:
    """Every family's microbatch counts exactly the window's targets per microbatch; the masked
    LM's inputs hold [MASK] exactly at its targets, and the bidirectional families' attention
    mask hides exactly the padding."""
    built = build_window(window)
    for mb, n in zip(built.microbatches, built.targets, strict=True):
        prepared = FAMILIES[family].prepare(mb)
        assert FAMILIES[family].count(prepared["labels"]) == n
        targets = prepared["labels"] != IGNORE_INDEX
        if family == "masked":
            assert torch.equal(prepared["input_ids"] == MASK_TOKEN, targets)
            assert torch.equal(prepared["labels"][targets], mb["input_ids"][targets])
        if family != "causal":
            assert torch.equal(prepared["attention_mask"].bool(), mb["input_ids"] != PAD_TOKEN)


def test_seq2seq_decoder_input_is_t5s_own() -> None:
    """The truth's decoder input is what T5ForConditionalGeneration builds from the labels."""
    model = MODEL_KINDS["t5"].build(torch.float32)
    for mb in build_window("zero").microbatches:
        labels = MODEL_KINDS["t5"].prepare(mb)["labels"][None]
        assert torch.equal(shift_right(labels), model._shift_right(labels))


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_family_loss_is_the_models_own_loss(kind: str) -> None:
    """On its family's microbatch the float64 loss sum the truth differentiates, divided by the
    count, is the model's own loss (`model(**batch).loss`, a mean): the truth uses the labels
    the model uses (causal LMs' own loss runs in float32: 1e-6)."""
    spec = MODEL_KINDS[kind]
    model = spec.build(torch.float32).to(torch.float64)
    for mb in build_window("unequal").microbatches:
        batch = {k: v[None] for k, v in spec.prepare(mb).items()}
        with torch.no_grad():
            ours = spec.loss_family.loss_sum(spec.loss_family.logits(model, batch), batch["labels"])
            own = model(**batch).loss
        n = spec.loss_family.count(batch["labels"])
        assert float(ours) / n == pytest.approx(float(own), rel=1e-6)


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[n] for n in CAUSAL + MEAN_LOSS], [build_window(w) for w in WINDOWS])


def _cell(result: AuditResult, loop: str, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.adapter == loop and c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.slow
@pytest.mark.parametrize("loop", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS)
def test_causal_lms_pass_with_the_true_count(result: AuditResult, loop: str, window: str) -> None:
    """Qwen2, GPT-NeoX and OPT route num_items_in_batch into ForCausalLMLoss: Trainer counts
    the shifted labels (the true count) and the float64 run is within the float32 bound."""
    cell = _cell(result, loop, window)
    assert cell.counted == cell.true_count
    assert cell.verdict == "pass" and cell.finite and cell.deterministic


@pytest.mark.slow
@pytest.mark.parametrize("loop", MEAN_LOSS)
@pytest.mark.parametrize("window", WINDOWS)
def test_masked_and_seq2seq_sum_the_microbatch_means(
    result: AuditResult, loop: str, window: str
) -> None:
    """BERT and T5 take **kwargs, so Trainer counts (right: the unshifted labels) and skips its
    division by K, but their forward returns a plain CrossEntropyLoss mean: the optimizer gets
    Σ_k mean_k (the float64 run's error is that prediction's, to float64 rounding for BERT's
    float64-clean copy and to float32 rounding for T5's, whose float64 copy computes its norms in
    float32 (:func:`tests.wacc.audit.expected.assert_mean_weighted_error`); K - 1 = 3 on the 4x64
    control)."""
    cell = _cell(result, loop, window)
    model = ADAPTERS[loop].model
    truth = compute_truth(MODEL_KINDS[model], torch.float32, build_window(window))
    dtype = "float64" if truth.float64_clean else "float32"
    assert (model == "bert") == truth.float64_clean
    assert cell.counted == cell.true_count
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, 1.0, dtype)
    assert cell.verdict == "FAIL"
    if window == "equal":
        bound = prediction_bound(mean_weighted_terms(truth, 1.0), dtype)
        assert_rel_l2_matches(cell.semantic_rel_l2, 3.0, bound, truth.gradient)


@pytest.mark.slow
def test_family_facts(result: AuditResult) -> None:
    """Every family reads the window first, resumes by replaying it bit-identically, has no
    fixed loss scale and no float16 compute off-GPU; BERT's float64 copy is clean, the rotary
    models' and T5's forward cast to float32 (reported)."""
    facts = {f.adapter.name: f for f in result.facts}
    replay = "no mid-window checkpoint; resume replays the window (bit-identical)"
    for name in CAUSAL + MEAN_LOSS:
        assert facts[name].needs_total == "yes"
        assert facts[name].resume == replay
        assert facts[name].loss_scale == "not settable"
        assert facts[name].fp16.startswith("no float16 compute")
    assert not facts["trainer-bert"].truth_casts
    for name in ("trainer-qwen2", "trainer-gpt_neox", "trainer-t5"):
        assert facts[name].truth_casts
