"""The part every reproducer script shares, as source text: the plain model written out, each
model family's microbatch and token-loss sum, the gradient vector, the exact gradient and the
result lines.  The family texts rebuild :mod:`wacc.audit.models`' prepared microbatches from
the window's token ids (``PAD``: the right padding and T5's decoder start token; ``MASK``: the
masked LM's [MASK] id)."""

from __future__ import annotations

__all__ = [
    "EXACT",
    "FAMILIES",
    "GRADIENT",
    "PLAIN_MODEL",
    "RANK_EXACT",
    "RANK_END",
    "RANK_GRADIENT",
    "RANK_RESULT",
    "RESULT",
]

PLAIN_MODEL = '''
class TinyCausalLM(torch.nn.Module):
    """wacc.audit.models.TinyCausalLM: forward returns the microbatch's mean token loss."""

    def __init__(self, vocab_size={vocab}, width={width}):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.position = torch.nn.Embedding({positions}, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab_size)

    def forward(self, input_ids, labels=None):
        length = input_ids.shape[-1]
        x = self.embed(input_ids) + self.position(torch.arange(length))
        steps = torch.arange(1, length + 1, dtype=x.dtype)
        x = torch.cumsum(x, dim=-2) / steps[:, None]  # causal: position t sees t and before
        logits = self.head(torch.tanh(self.hidden(x)))
        if labels is None:
            return {{"logits": logits}}
        flat = logits[..., :-1, :].reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, labels[..., 1:].reshape(-1), ignore_index=-100)
        return {{"logits": logits, "loss": loss}}
'''

_CAUSAL = '''
def microbatch(tokens, labelled, width):
    """Causal LM: the labels are the input ids (the model shifts them), right-padded."""
    pad = width - len(tokens)
    labels = tokens if labelled else [-100] * len(tokens)
    ids, labels = tokens + [{pad}] * pad, labels + [-100] * pad
    return {{"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}}


def token_loss_sum(model, batch):  # position t predicts token t + 1
    logits = model(**batch)["logits"][:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
'''

_UNSHIFTED = '''
def microbatch(tokens, labelled, width):
    """{what}, right-padded."""
    pad = width - len(tokens)
    labels = [-100] + tokens[1:] if labelled else [-100] * len(tokens)
    ids = torch.tensor(tokens + [{pad}] * pad)
    labels = torch.tensor(labels + [-100] * pad)
    return {{
        "input_ids": {input_ids},
        "attention_mask": (ids != {pad}).long(),
        "labels": labels,
    }}


def token_loss_sum(model, batch):
    logits = model(**batch)["logits"]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
'''

FAMILIES: dict[str, str] = {
    "causal": _CAUSAL,
    "masked": _UNSHIFTED.replace(
        "{what}", "Masked LM: every token after the first is a target, [MASK]ed in the input"
    ).replace("{input_ids}", "ids.masked_fill(labels != -100, {mask})"),
    "seq2seq": _UNSHIFTED.replace(
        "{what}", "Seq2seq: the encoder reads the tokens, the decoder predicts all but the first"
    ).replace("{input_ids}", "ids"),
}
"""``microbatch`` and ``token_loss_sum`` per family (``{pad}``/``{mask}``: the ids)."""

GRADIENT = """
def gradient(model):  # every parameter's .grad as one float64 vector
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return torch.cat([g.detach().double().flatten() for g in grads])


width = max(len(tokens) for tokens in TOKENS)
batches = [microbatch(tokens, labelled, width) for tokens, labelled in zip(TOKENS, LABELLED)]
targets = [len(tokens) - 1 if labelled else 0 for tokens, labelled in zip(TOKENS, LABELLED)]
"""

EXACT = """
# Exact: the gradient of the window's mean token loss (the sum over every target token, one
# backward, divided by their true count) on a float64 copy of the same model.
exact_model = build_model().double()
sum(token_loss_sum(exact_model, {k: v[None] for k, v in b.items()}) for b in batches).backward()
exact = gradient(exact_model) / sum(targets)
"""

RESULT = """
error = ((grads - exact).norm() / exact.norm()).item()
print(f"rel L2 error of {framework} accumulation vs exact: {{error:.15g}}")
print(f"target tokens {{targets}}, true total {{sum(targets)}}; the loop divided by: {{counted}}")
"""

RANK_GRADIENT = """
def gradient(model):  # every parameter's .grad as one float64 vector
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return torch.cat([g.detach().double().flatten() for g in grads])


def pairs_of(r):
    return RANK_TOKENS[r], RANK_LABELLED[r]


def window(r):  # rank r's microbatches, right-padded to its own longest sequence, and its targets
    width = max(len(tokens) for tokens in RANK_TOKENS[r])
    batches = [microbatch(tokens, labelled, width) for tokens, labelled in zip(*pairs_of(r))]
    targets = [len(t) - 1 if labelled else 0 for t, labelled in zip(*pairs_of(r))]
    return batches, targets


dist.init_process_group("gloo")  # the torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT
rank = dist.get_rank()
if dist.get_world_size() != len(RANK_TOKENS):
    raise SystemExit(f"run with --nproc-per-node {len(RANK_TOKENS)}")
batches, targets = window(rank)  # this rank's window
every = [window(r) for r in range(len(RANK_TOKENS))]
all_batches = [b for batches_r, _ in every for b in batches_r]
all_targets = [n for _, targets_r in every for n in targets_r]
"""

RANK_EXACT = """
# Exact: the gradient of the mean token loss over every rank's tokens (the sum over all of them,
# one backward, divided by their true count) on a float64 copy of the same model.
exact_model = build_model().double()
sum(token_loss_sum(exact_model, {k: v[None] for k, v in b.items()}) for b in all_batches).backward()
exact = gradient(exact_model) / sum(all_targets)
"""

RANK_RESULT = """
gathered = [torch.zeros_like(grads) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, grads)  # every rank's gradient, to see whether they agree
if rank == 0:
    error = ((grads - exact).norm() / exact.norm()).item()
    print(f"rel L2 error of {framework} accumulation vs exact: {{error:.15g}}")
    totals = [sum(targets_r) for _, targets_r in every]
    print(f"target tokens per rank {{totals}}, true total {{sum(totals)}}")
    print(f"rank 0 divided by: {{counted}}")
    print(f"ranks agree: {{all(torch.equal(g, grads) for g in gathered)}}")
"""

# After RANK_RESULT; ``{delete}`` is a ``del`` of the names the loop's part assigned, or nothing.
RANK_END = """
# This rank's loop goes before its process group does: a framework object still holding the
# group (DDP's reducer) would be freed at interpreter exit, where gloo can abort the process
# (torch 2.13: "terminate called without an active exception", about 1 run in 10 on 2 busy cores).
{delete}gc.collect()  # and what the loop left in reference cycles
dist.destroy_process_group()
"""
