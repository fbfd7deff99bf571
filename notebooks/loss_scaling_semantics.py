# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Loss-scaling semantics of gradient accumulation, on a real small model
#
# This walkthrough runs a tiny two-layer MLP with token cross-entropy and shows four things
# with numbers computed here, not quoted:
#
# 1. why the common `loss /= accum_steps` loop is wrong when microbatches hold unequal token
#    counts, and what `wacc_torch.WeightedGradientsAccumulator` computes instead;
# 2. why dividing once by `S * W` (loss scale times total tokens) overflows in float16, while
#    dividing by `S` and then by `W` stays finite;
# 3. what a zero-weight microbatch (every token masked) does: it is counted, its gradient is
#    never read, and a window of only such microbatches refuses to produce a mean without
#    losing anything;
# 4. a checkpoint in the middle of an accumulation window, saved and loaded through real files,
#    resumes to a bit-identical result.
#
# The truth everywhere is the full-batch gradient computed in float64: one backward pass over
# all tokens of the window, with the per-token mean over the window's tokens.

# %%
import copy
import math
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.nn import functional as F

from wacc.baselines import scale_times_weight
from wacc_torch import WeightedGradientsAccumulator, ZeroTotalWeightError

torch.manual_seed(0)
FEATURES, HIDDEN, CLASSES = 16, 32, 10


def make_model() -> nn.Module:
    """The same freshly initialised float32 MLP every time (a fixed seed)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def make_window(token_counts: list[int], *, seed: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """One accumulation window: (inputs, targets) per microbatch, one row per token."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(tokens, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (tokens,), generator=generator),
        )
        for tokens in token_counts
    ]


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    """All gradient elements in one float64 vector."""
    return torch.cat([g.detach().reshape(-1).double() for g in grads])


def full_batch_gradient(model: nn.Module, window: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The truth: the gradient of the per-token mean loss over the whole window, in float64."""
    exact = copy.deepcopy(model).double()
    inputs = torch.cat([x for x, _ in window]).double()
    targets = torch.cat([y for _, y in window])
    F.cross_entropy(exact(inputs), targets).backward()
    return flat([p.grad for p in exact.parameters()])


def relative_error(approx: torch.Tensor, truth: torch.Tensor) -> float:
    """Norm-wise relative error ||approx - truth|| / ||truth|| (inf if approx is not finite)."""
    if not torch.isfinite(approx).all():
        return math.inf
    return float((approx - truth).norm() / truth.norm())


# %% [markdown]
# ## 1. Unequal microbatches: `loss /= accum_steps` weighs a 1-token microbatch like a 200-token one
#
# A window of four microbatches with 1, 7, 200 and 3 tokens (211 in all). The common loop
# divides each microbatch's *mean* loss by the number of microbatches and lets autograd sum the
# gradients in `.grad`: every microbatch gets weight 1/4, whatever its size.
# `wacc_torch` weighs each microbatch's mean-loss gradient by its token count, divides by the
# loss scale `S` exactly once and by the total token count `W` once.

# %%
TOKENS = [1, 7, 200, 3]
LOSS_SCALE = 2.0**10  # fixed for the run; exactly representable in the work dtype


def common_loop(model: nn.Module, window: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The `loss /= accum_steps` loop: autograd sums each microbatch's mean-loss gradient / K."""
    model.zero_grad(set_to_none=True)
    for inputs, targets in window:
        loss = F.cross_entropy(model(inputs), targets) / len(window)
        loss.backward()
    return flat([p.grad for p in model.parameters()])


def wacc_loop(
    model: nn.Module, window: list[tuple[torch.Tensor, ...]], *, dtype: torch.dtype
) -> torch.Tensor:
    """The same window through `WeightedGradientsAccumulator` (weight = token count)."""
    model.zero_grad(set_to_none=True)
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
    for inputs, targets in window:
        loss = F.cross_entropy(model(inputs), targets)  # a per-token MEAN
        (LOSS_SCALE * loss).backward()
        accumulator.accumulate_mean(model, targets.numel())
    return flat(list(accumulator.finish_mean().grads.values()))


model = make_model()
window = make_window(TOKENS)
truth = full_batch_gradient(model, window)
rel_common = relative_error(common_loop(model, window), truth)
rel_wacc = relative_error(wacc_loop(model, window, dtype=torch.float32), truth)
print(f"token counts {TOKENS}, total {sum(TOKENS)}")
print(f"common loop relative error: {rel_common:.3e}")
print(f"wacc_torch relative error: {rel_wacc:.3e}")
print(f"ratio common / wacc_torch: {rel_common / rel_wacc:.3g}")
assert rel_common > 10 * rel_wacc

# %% [markdown]
# The common loop's gradient is not close to the true one at all: it is the mean of the four
# microbatch means, dominated by the 1-, 7- and 3-token microbatches. `wacc_torch` in float32 is
# off by float32 rounding only (about `1e-7`). The weights each loop gives the microbatches say
# why:

# %%
true_share = [tokens / sum(TOKENS) for tokens in TOKENS]
loop_share = [1 / len(TOKENS)] * len(TOKENS)
positions = range(len(TOKENS))
fig, ax = plt.subplots(figsize=(7, 4))
ax.bar([p - 0.2 for p in positions], true_share, width=0.4, label="token-weighted (wacc_torch)")
ax.bar([p + 0.2 for p in positions], loop_share, width=0.4, label="loss /= accum_steps")
ax.set_xticks(
    list(positions),
    [f"microbatch {i + 1}\n{t} token{'s' * (t != 1)}" for i, t in enumerate(TOKENS)],
)
ax.set_yscale("log")
ax.set_ylabel("weight in the averaged gradient (log scale)")
ax.set_title("Weight each microbatch gets in one window of 211 tokens")
ax.legend()
fig.tight_layout()
plt.show()
for tokens, share in zip(TOKENS, true_share, strict=True):
    print(f"{tokens:4d} tokens: true weight {share:.4f}, common loop 0.25 ({0.25 / share:.3g}x)")

# %% [markdown]
# How the error grows with the imbalance: a window of two microbatches, one token and `k`
# tokens. With `k = 1` both loops agree (to float32 rounding); from `k = 2` on the common
# loop's error is tens of percent and grows with `k` (past 100 %: the 1-token microbatch's
# gradient is far larger than the true mean), while `wacc_torch`'s stays at float32 rounding.

# %%
imbalance = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
errors_common, errors_wacc = [], []
for k in imbalance:
    pair = make_window([1, k], seed=3)
    pair_truth = full_batch_gradient(model, pair)
    errors_common.append(relative_error(common_loop(model, pair), pair_truth))
    errors_wacc.append(relative_error(wacc_loop(model, pair, dtype=torch.float32), pair_truth))

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(imbalance, errors_common, "o-", label="loss /= accum_steps (float32)")
ax.plot(imbalance, errors_wacc, "s-", label="wacc_torch (float32)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens in the larger microbatch k (the other has 1 token)")
ax.set_ylabel("relative error vs float64 full batch")
ax.set_title("Gradient error as microbatch sizes diverge")
ax.grid(True, which="major", alpha=0.3)
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. `S * W` overflows float16; `S` then `W` does not
#
# With a float16 work dtype (what an fp16 accumulator holds), loss scale `S = 2**15` and a
# window of `W = 4096` tokens, a common shortcut divides the accumulated sums once by `S * W`.
# The product `2**27` is far beyond float16's largest finite value 65504, so in float16 it
# rounds to `inf`, and every gradient divided by it becomes 0. `wacc_torch` divides by `S`
# first and then by `W`, so no intermediate leaves the range. (The
# `wacc.baselines.scale_times_weight` baseline is exactly that shortcut, on the same
# accumulation otherwise.)
#
# Loss scaling is used where gradients are small (near convergence, per-token gradients
# underflow float16 without it). The model here is a linear regression whose targets it almost
# fits, so its mean gradient is at most about `3e-4` per element: small enough that the scaled
# sums `S * sum(w * g)` (up to `2**27 * 3e-4`, about 41 000) stay finite in float16.

# %%
FP16_SCALE, FP16_TOKENS = 2.0**15, [1024, 1024, 1024, 1024]
print(f"float16 max finite: {torch.finfo(torch.float16).max}")
product = torch.tensor(FP16_SCALE, dtype=torch.float16) * torch.tensor(4096.0, dtype=torch.float16)
print(f"S * W in float16: {product.item()}")

torch.manual_seed(4)
regression = nn.Linear(FEATURES, 4)
teacher = copy.deepcopy(regression)  # the targets' model: the regression's weights, nudged
with torch.no_grad():
    for parameter in teacher.parameters():
        parameter.add_(3e-4 * torch.randn_like(parameter))
generator = torch.Generator().manual_seed(5)
fp16_window = []
for tokens in FP16_TOKENS:
    inputs = torch.randn(tokens, FEATURES, generator=generator)
    with torch.no_grad():
        fp16_window.append((inputs, teacher(inputs)))


def regression_truth() -> torch.Tensor:
    exact = copy.deepcopy(regression).double()
    inputs = torch.cat([x for x, _ in fp16_window]).double()
    targets = torch.cat([y for _, y in fp16_window]).double()
    F.mse_loss(exact(inputs), targets).backward()
    return flat([p.grad for p in exact.parameters()])


def fp16_accumulate(make, scale: float) -> torch.Tensor:
    """The float16 window through ``make(dtype, loss_scale)``'s accumulator, weight = tokens."""
    accumulator = make(torch.float16, scale)
    regression.zero_grad(set_to_none=True)
    for inputs, targets in fp16_window:
        loss = F.mse_loss(regression(inputs), targets)  # a per-token MEAN
        (scale * loss).backward()
        accumulator.accumulate_mean(regression, targets.shape[0])
    return flat(list(accumulator.finish_mean().grads.values()))


def wacc_torch_factory(dtype: torch.dtype, loss_scale: float) -> WeightedGradientsAccumulator:
    return WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)


fp16_truth = regression_truth()
print(f"max |mean gradient| (float64): {fp16_truth.abs().max():.3e}")
shortcut = fp16_accumulate(scale_times_weight, FP16_SCALE)
sequential = fp16_accumulate(wacc_torch_factory, FP16_SCALE)
rel_shortcut = relative_error(shortcut, fp16_truth)
rel_sequential = relative_error(sequential, fp16_truth)
print(
    f"scale_times_weight: all zero {bool((shortcut == 0).all())}, "
    f"relative error: {rel_shortcut:.3e}"
)
print(
    f"wacc_torch sequential: all finite {bool(torch.isfinite(sequential).all())}, "
    f"relative error: {rel_sequential:.3e}"
)
assert rel_shortcut == 1.0 and rel_sequential < 0.1 * rel_shortcut

# %% [markdown]
# Over loss scales (powers of two, exact in float16): the sequential division's error stays at
# float16 rounding for every `S`; from `S = 16` on, `S * 4096` exceeds 65504 and the shortcut
# returns zeros (relative error 1). The one limit left is the sums themselves: they overflow
# once `S * W * |mean gradient|` passes 65504, which no division order can repair (here that
# would take `S = 2**16`, which float16 cannot even hold): that is what choosing `S` is about.

# %%
scales = [2.0**e for e in range(0, 16)]
curve_shortcut, curve_sequential = [], []
for scale in scales:
    curve_shortcut.append(relative_error(fp16_accumulate(scale_times_weight, scale), fp16_truth))
    curve_sequential.append(relative_error(fp16_accumulate(wacc_torch_factory, scale), fp16_truth))

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(scales, curve_shortcut, "o-", label="divide by S·W at once (scale_times_weight)")
ax.plot(scales, curve_sequential, "s-", label="divide by S, then by W (wacc_torch)")
ax.axvline(65504 / 4096, color="grey", linestyle="--", label="S·W = 65504 (float16 max)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("loss scale S (W = 4096 tokens, float16 work dtype)")
ax.set_ylabel("relative error vs float64 full batch")
ax.set_title("float16: one division by S·W overflows, two divisions do not")
ax.grid(True, which="major", alpha=0.3)
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Zero-weight microbatches: counted, never read, nothing lost
#
# A microbatch whose tokens are all masked out (padding, or prompt tokens excluded from the
# loss) has weight 0. The usual hand-written masked mean, `(loss * mask).sum() / mask.sum()`,
# is `0 / 0` there: its loss and its gradient are NaN. The common loop adds that NaN into
# `.grad` and the whole step is poisoned. `wacc_torch` counts the microbatch as issued (and as
# zero-weight), clears `.grad` without reading it, and the result is bit-identical to the
# window without it.


# %%
def masked_mean_loss(inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """The per-token mean over the unmasked tokens, written as most training code writes it."""
    per_token = F.cross_entropy(model(inputs), targets, reduction="none")
    return (per_token * mask).sum() / mask.sum()


masked = [(x, y, torch.ones(len(y))) for x, y in make_window([5, 3, 9], seed=6)]
masked[1] = (masked[1][0], masked[1][1], torch.zeros(3))  # every token of microbatch 2 masked

model.zero_grad(set_to_none=True)
for inputs, targets, mask in masked:
    (masked_mean_loss(inputs, targets, mask) / len(masked)).backward()
common_nan = any(p.grad.isnan().any().item() for p in model.parameters())
print("common loop: .grad has NaN:", common_nan)


def masked_wacc(batches) -> tuple[WeightedGradientsAccumulator, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    for inputs, targets, mask in batches:
        (LOSS_SCALE * masked_mean_loss(inputs, targets, mask)).backward()
        accumulator.accumulate_mean(model, int(mask.sum()))  # weight: the unmasked tokens
    state = accumulator.state
    return state, accumulator.finish_mean().grads


state_with_zero, with_zero = masked_wacc(masked)
print("wacc_torch state:", state_with_zero)
_, without_zero = masked_wacc([masked[0], masked[2]])
identical = all(torch.equal(with_zero[name], without_zero[name]) for name in with_zero)
print("zero-weight microbatch changes nothing, bit-identical:", identical)
assert common_nan and identical and state_with_zero.zero_weight == 1

# %% [markdown]
# A window of only zero-weight microbatches has no mean (`W = 0`). `finish_mean` raises
# `ZeroTotalWeightError` and clears nothing: the window stays open, and the next microbatch
# with tokens completes it.

# %%
model.zero_grad(set_to_none=True)
accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
inputs, targets, mask = masked[1]
for _ in range(2):
    (LOSS_SCALE * masked_mean_loss(inputs, targets, mask)).backward()
    accumulator.accumulate_mean(model, int(mask.sum()))
before = accumulator.state
try:
    accumulator.finish_mean()
    raised = False
except ZeroTotalWeightError as error:
    raised = True
    print("finish_mean raised ZeroTotalWeightError:", error)
print("state unchanged by the raise:", accumulator.state == before)
inputs, targets, mask = masked[0]
(LOSS_SCALE * masked_mean_loss(inputs, targets, mask)).backward()
accumulator.accumulate_mean(model, int(mask.sum()))
print("after one real microbatch:", accumulator.state)
completed = accumulator.finish_mean()
print(
    f"finished: issued={completed.issued}, zero_weight={completed.zero_weight}, "
    f"W={completed.weight}"
)
assert (
    raised
    and accumulator.state.issued == 0
    and (completed.issued, completed.zero_weight)
    == (
        3,
        2,
    )
)


# %% [markdown]
# ## 4. Mid-window resume: bit-identical through a real file
#
# Interrupt the window of section 1 after its first two microbatches: `state_dict()` holds the
# pending sums, the counters and `W` as plain tensors and numbers, so it goes through
# `torch.save` and comes back with `torch.load(weights_only=True)` (no pickled code). A fresh
# accumulator loads it and finishes the window; the result equals the uninterrupted run bit for
# bit.


# %%
def run_window(batches, accumulator) -> None:
    model.zero_grad(set_to_none=True)
    for inputs, targets in batches:
        (LOSS_SCALE * F.cross_entropy(model(inputs), targets)).backward()
        accumulator.accumulate_mean(model, targets.numel())


straight = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
run_window(window, straight)
uninterrupted = straight.finish_mean()

first = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
run_window(window[:2], first)
with tempfile.TemporaryDirectory() as directory:
    path = Path(directory) / "accumulator.pt"
    torch.save(first.state_dict(), path)
    del first  # the process that wrote the checkpoint is gone
    record = torch.load(path, map_location="cpu", weights_only=True)
print("record fields:", sorted(record))
resumed = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
resumed.load_state_dict(record, model)
print("resumed state:", resumed.state)
run_window(window[2:], resumed)
after_resume = resumed.finish_mean()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)  # the float32 bit patterns, compared exactly


bit_identical = all(
    torch.equal(bits(uninterrupted.grads[name]), bits(after_resume.grads[name]))
    for name in uninterrupted.grads
)
print("resume bit-identical:", bit_identical)
assert bit_identical
