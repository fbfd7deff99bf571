"""torchtune's full-finetune recipes (:mod:`wacc.audit.adapters.torchtune`): the recipe class
loaded from the ``recipes`` folder torchtune installs beside its package, its ``train()`` run on
an object whose ``setup()`` (checkpoint files, tokenizer and data set from a YAML config) is
replaced by the window's objects, as the adapter does: the model behind a decoder's
``forward(tokens) -> logits``, ``torch.nn.CrossEntropyLoss()``, batch size 1 with torchtune's
``padded_collate_sft`` in the loader its ``_setup_data`` builds (``StatefulDataLoader`` over a
``StatefulDistributedSampler``), one epoch of K batches, ``torch.optim.SGD``;
``training.scale_grads`` is wrapped to print the factor the recipe hands it.  Across ranks
(``full_finetune_distributed``): FSDP2 through ``training.shard_model`` on a CPU device mesh of
every rank (every leaf module its own unit, as the recipe's ``custom_sharded_layers`` make it),
the recipe's ``StatefulDistributedSampler(num_replicas=N, rank=r)`` over every rank's
microbatches interleaved (item ``i * N + r`` is rank ``r``'s microbatch ``i``), the gradient read
by gathering every shard (``DTensor.full_tensor()``); torchtune's ``cleanup_before_training``
(``torch.cpu`` has no ``empty_cache``) is ``gc.collect()`` there."""

from __future__ import annotations

__all__ = ["BODY", "IMPORTS", "RANKS", "RANKS_IMPORTS"]

IMPORTS = (
    "import importlib.util",
    "import os",
    "from functools import partial",
    "import torchtune",
    "from torchtune import training",
    "from torchtune.data import padded_collate_sft",
    "from torchdata.stateful_dataloader import StatefulDataLoader",
    "from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler",
)

_COMMON = """
def recipe_class(name, attribute):  # recipes/<name>.py, beside the torchtune package
    path = os.path.join(os.path.dirname(os.path.dirname(torchtune.__file__)), "recipes", name)
    spec = importlib.util.spec_from_file_location(name, path + ".py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attribute)


class Decoder(torch.nn.Module):  # a torchtune TransformerDecoder's interface: tokens -> logits
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens)["logits"]


class Silent:  # the recipe's metric logger
    def log_dict(self, payload, step):
        pass

    def close(self):
        pass


def rows(window_batches):  # what torchtune's SFT data sets yield: token and label lists
    return [{"tokens": b["input_ids"].tolist(), "labels": b["labels"].tolist()}
            for b in window_batches]


factors = []
scale_grads = training.scale_grads


def observed_scale_grads(module, scaler):  # the recipe calls training.scale_grads(model, ...)
    factors.append(float(scaler))
    scale_grads(module, scaler)


training.scale_grads = observed_scale_grads
loss_fn = torch.nn.CrossEntropyLoss()
collate = partial(padded_collate_sft, padding_idx=0, ignore_idx=loss_fn.ignore_index)
"""

_STATE = """
for name, value in dict(
    _model=model, _loss_fn=loss_fn, _optimizer=optimizer, _dataloader=loader,
    _gradient_accumulation_steps=len(batches), _steps_per_epoch=1, max_steps_per_epoch=None,
    epochs_run=0, total_epochs=1, global_step=0, _compile=False, _optimizer_in_bwd=False,
    _clip_grad_norm=None, _lr_scheduler=None, _log_every_n_steps=1,
    _log_peak_memory_stats=False, _device=torch.device("cpu"), profiler_profile_memory=False,
    _profiler=training.DummyProfiler(),
    activations_handling_ctx=training.get_act_offloading_ctx_manager(model, False),
    ignore_labels_cache=torch.full((1, 1), loss_fn.ignore_index), _metric_logger=Silent(),
).items():
    setattr(recipe, name, value)
"""

BODY = (
    _COMMON
    + """
Recipe = recipe_class("full_finetune_single_device", "FullFinetuneRecipeSingleDevice")
inner = build_model()
inner.train()
model = Decoder(inner)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the configs: AdamW; read before it steps
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(inner)))
dataset = rows(batches)
sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
loader = StatefulDataLoader(dataset, batch_size=1, sampler=sampler, collate_fn=collate,
                            drop_last=True)
recipe = Recipe.__new__(Recipe)  # setup() reads checkpoint files and a tokenizer: set here
"""
    + _STATE
    + """recipe.save_checkpoint = lambda epoch: None  # called once after the epoch
recipe.train()  # recipes/full_finetune_single_device.py L656-713
grads = captured[0]
counted = f"num_tokens {round(1 / factors[0])} (scale_grads factor 1 / num_tokens)"
"""
)

RANKS_IMPORTS = (*IMPORTS, "from torch.distributed.device_mesh import init_device_mesh")
RANKS = (
    _COMMON
    + """

class NoCheckpoint:  # the recipe's checkpoint client: its end-of-epoch save writes nothing
    def save_checkpoint(self, **kwargs):
        pass


Recipe = recipe_class("full_finetune_distributed", "FullFinetuneRecipeDistributed")
world = dist.get_world_size()
model = Decoder(build_model())
model.train()
# _setup_model: a CPU mesh of every rank, FSDP2 on every leaf module, then on the root.
mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
conditions = [partial(training.get_shard_conditions, names_to_match=leaves)]
training.shard_model(model=model, shard_conditions=conditions, cpu_offload=False,
                     reshard_after_forward=True, dp_mesh=mesh["dp"])
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the configs: AdamW; read before it steps
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(torch.cat(
    [p.grad.full_tensor().double().flatten() for p in model.parameters()])))
# _setup_data: every rank's microbatches interleaved, this rank's picked by the recipe's sampler.
every_rows = [rows(batches_r) for batches_r, _ in every]
dataset = [every_rows[r][i] for i in range(len(batches)) for r in range(world)]
sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
loader = StatefulDataLoader(dataset, batch_size=1, sampler=sampler, collate_fn=collate,
                            drop_last=True)
recipe = Recipe.__new__(Recipe)  # __init__ would init_process_group again: its state set here
"""
    + _STATE
    + """recipe.world_size, recipe._is_rank_zero = world, rank == 0
recipe._checkpoint_client, recipe.seed = NoCheckpoint(), 0  # the end-of-epoch save's
training.cleanup_before_training = gc.collect  # its torch.cpu.empty_cache() does not exist
recipe.train()  # recipes/full_finetune_distributed.py L740-929: all_reduce(num_tokens) ...
grads = captured[0]
counted = f"all-reduced num_tokens {round(world / factors[0])} (factor world_size / num_tokens)"
"""
)
