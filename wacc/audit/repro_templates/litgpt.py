"""litgpt's full fine-tuning loop (``litgpt/finetune/full.py`` ``fit``, L272-294; see
:mod:`wacc.audit.adapters.litgpt`) on a ``lightning.Fabric`` on the CPU, as ``setup`` and
``main`` build it: ``fabric.launch(main, ...)``, ``fabric.setup(model)``,
``fabric.setup_optimizers``, ``fabric.setup_dataloaders``, then ``fit``'s lines with litgpt's own
``TrainArgs``, ``CycleIterator`` and ``chunked_cross_entropy``; the model behind a wrapper whose
``forward(input_ids)`` returns the logits (what a litgpt ``GPT`` returns).  ``BODY`` and
``BF16_BODY``: one device (``strategy="auto"``), precision ``32-true`` / ``bf16-mixed``;
``RANKS`` and ``BF16_RANKS``: the same under ``torch.distributed.run`` with Fabric's
``DDPStrategy(process_group_backend="gloo")`` (litgpt's ``FSDPStrategy`` is refused by Fabric on
a CPU), ``TrainArgs(global_batch_size=K * N)`` and each rank reading its own window
(``use_distributed_sampler=False``)."""

from __future__ import annotations

__all__ = ["BF16_BODY", "BF16_RANKS", "BODY", "IMPORTS", "RANKS"]

IMPORTS = (
    "import lightning as L",
    "from litgpt.args import TrainArgs",
    "from litgpt.utils import CycleIterator, chunked_cross_entropy",
)

_LOOP = """
class Logits(torch.nn.Module):  # a litgpt GPT's forward: input_ids -> logits
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)["logits"]


captured = []


def main(fabric, train, devices, num_nodes):  # full.py main's setup, then fit L272-294
    model = build_model()
    model.train()
    wrapped = fabric.setup(Logits(model))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.0)  # litgpt: AdamW; read before it steps
    optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
    optimizer = fabric.setup_optimizers(optimizer)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(batches, batch_size=1),
        use_distributed_sampler=False,  # each rank reads its own window, in order
    )
    state = {"iter_num": 0, "step_count": 0}
    train_iterator = CycleIterator(loader)
    while state["step_count"] < 1:  # fit's loop, up to its first optimizer step
        state["iter_num"] += 1
        batch = next(train_iterator)
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = (
            state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0
        )
        with fabric.no_backward_sync(wrapped, enabled=is_accumulating):
            logits = wrapped(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss / train.gradient_accumulation_iters(devices, num_nodes))
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1


devices, num_nodes = 1, 1
fabric = L.Fabric(
    accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="auto", precision="32-true"
)
# fit's global batch is every rank's: K microbatches of one sequence per rank and step.
train = TrainArgs(
    global_batch_size=len(batches) * devices * num_nodes, micro_batch_size=1, epochs=1
)
fabric.launch(main, train, devices, num_nodes)
grads = captured[0]
counted = "each microbatch's own mean"
"""

_ONE = "devices, num_nodes = 1, 1"
_WORLD = "devices, num_nodes = dist.get_world_size(), 1"
# litgpt's setup picks FSDPStrategy on more than one device; Fabric refuses it on a CPU.
_AUTO = 'strategy="auto"'
_DDP = 'strategy=L.fabric.strategies.DDPStrategy(process_group_backend="gloo")'
_BF16 = ('precision="32-true"', 'precision="bf16-mixed"')

BODY = _LOOP
BF16_BODY = BODY.replace(*_BF16)
RANKS = _LOOP.replace(_ONE, _WORLD).replace(_AUTO, _DDP)
BF16_RANKS = RANKS.replace(*_BF16)
assert _DDP in RANKS and _BF16[1] in BF16_BODY and _BF16[1] in BF16_RANKS  # every edit was found
