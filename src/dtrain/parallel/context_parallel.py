"""Context parallelism: each sample's sequence cut over the cp ranks, attention over all of it.

**The cut.** A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); context rank r
holds chunks r and 2 cp - 1 - r (head-tail load balancing, as Megatron's and torch's context
parallelism do for causal attention: every rank then holds the same share of the causal
mask's work). The inputs and the targets are cut alike, and the model is told the true
position of every token it holds (``position_ids``), which its position embeddings need.

**Attention** sees the whole sequence while a step runs (`dtrain.parallel.context_attention`).

**The loss.** Each rank's loss is the mean over its tokens: every rank holds as many, so
the mean over the data- and context-parallel ranks, which their gradient averaging
computes, is the mean over every token of the global batch. Where some targets are not
scored (-100, or a Hugging Face model's masked labels) each rank's mean is weighted by its
share of the scored ones (`SequenceCut.share`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError, SetupError
from dtrain.parallel.collective_timing import CollectiveTiming
from dtrain.parallel.context_attention import WholeSequence, held_chunks
from dtrain.parallel.hf_context import attention_switch
from dtrain.step.batches import IGNORE_INDEX, LabelCounter, LossFn, is_pair


def check_positions(model: nn.Module, cp: int) -> None:
    """Refuse, by name, a model that cannot be told its tokens' positions under `cp`
    context ranks (its forward takes no ``position_ids``)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ConfigError(
            f"--cp {cp} cuts each sample's sequence over {cp} ranks, so the model must be "
            f"told each token's position, but {type(model).__name__}.forward takes no "
            "position_ids argument. Give its forward a position_ids=None argument used by "
            "its position embeddings (dtrain passes each rank's positions), or drop --cp."
        )


class SequenceCut:
    """How this rank cuts each batch's sequence and attends over the whole of it.

    Args:
        group: the context-parallel ranks of this rank's data-parallel share.
        model_class: the model's class name, for messages.
    """

    def __init__(self, group: dist.ProcessGroup, model_class: str = "the model") -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.model_class = model_class
        self.shifts_labels = False
        """The model's own loss predicts each label from the token before it (a Hugging
        Face causal LM): its labels are shifted before the cut, not after."""
        self._switch: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )
        self.attention = WholeSequence(group)
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._checked = False
        """The context ranks were found to hold the same batch (checked at the first cut)."""
        self._positions: torch.Tensor | None = None
        """The positions of the tokens of the step's cut, while it runs."""

    def check_model(
        self, model: nn.Module, counter: LabelCounter | None, timing: CollectiveTiming
    ) -> None:
        """Refuse, by name, a model that cannot be told its tokens' positions; refuse a
        forward that builds a graph outside a step's cut (a loop written by hand).
        `counter`: how the model's own loss counts its labels, if it has one; `timing`:
        whom to tell when the gathers start and end (the step's breakdown)."""
        self.attention.timing = timing
        self.model_class = self.attention.model_class = type(model).__name__
        self.shifts_labels = counter is not None and counter.shifted
        self._switch = attention_switch(model)
        check_positions(model, self.cp)
        self._hook = model.register_forward_pre_hook(self._outside_a_step)

    def release(self) -> None:
        """Take the cut's hook off the model (the strategy is closing)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _outside_a_step(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self._positions is None:
            raise SetupError(
                f"Under --cp {self.cp} dtrain cuts each batch's sequence inside "
                "engine.train_step; a forward of the model outside it would attend within "
                "each rank's whole batch. Train with engine.train_step(batch, loss_fn), "
                "evaluate with engine.evaluate or under torch.no_grad()."
            )

    def cut(self, batch: Any, loss_fn: LossFn | None) -> tuple[Any, torch.Tensor]:
        """(this rank's part of `batch`, the positions of its tokens (N, T / cp)): an
        ``(inputs, targets)`` pair whose inputs are (N, T, ...) token sequences and whose
        targets are (N, T, ...) per token, or a dict of ``input_ids`` (N, T) and what goes
        with them (`_cut_dict`). The first cut checks that every context rank holds the
        same batch (a collective over them)."""
        tokens = self._tokens(batch, loss_fn)
        if not self._checked:
            self._same_everywhere(tokens)
            self._checked = True
        index, positions = self._held(tokens)
        if isinstance(batch, Mapping):
            return self._cut_dict(batch, index), positions
        inputs, targets = batch
        return (inputs.index_select(1, index), targets.index_select(1, index)), positions

    def _tokens(self, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
        """The (N, T) tokens `batch` is cut along, or a ConfigError (the same on every rank,
        before any collective) for a batch the cut cannot honour."""
        if isinstance(batch, Mapping):
            return self._dict_tokens(batch, loss_fn)
        if not is_pair(batch):
            raise ConfigError(
                f"--cp cuts (inputs, targets) batches of token sequences or dicts of "
                f"input_ids; this batch is a {type(batch).__name__}. Pass one of those, "
                "or drop --cp."
            )
        inputs, targets = batch
        if inputs.dim() < 2 or targets.dim() < 2 or targets.shape[:2] != inputs.shape[:2]:
            raise ConfigError(
                f"--cp cuts the sequence (dimension 1) of the inputs and targets alike; got "
                f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)}. Give "
                "one target per token, or drop --cp."
            )
        return inputs

    def _dict_tokens(self, batch: Mapping[str, Any], loss_fn: LossFn | None) -> torch.Tensor:
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ConfigError(
                "--cp cuts a dict batch's input_ids (N, T), which this batch does not hold; "
                "pass input_ids, or drop --cp."
            )
        given = [key for key in ("attention_mask", "position_ids") if key in batch]
        if given:
            raise ConfigError(
                f"--cp cuts each sequence and gives the model its tokens' positions itself; "
                f"the batch's {' and '.join(given)} would describe the whole sequence (or "
                "padding, which the cut cannot honour). Give batches of unpadded sequences "
                f"without {' or '.join(given)}, or drop --cp."
            )
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.shape[:2] != ids.shape:
            raise ConfigError(
                f"--cp cuts each sequence, but the batch's labels {tuple(labels.shape)} are "
                f"not one per token of input_ids {tuple(ids.shape)} (a label per sequence, "
                "as a classifier's): each rank would score its slice alone. Drop --cp for "
                "such a model."
            )
        if labels is not None and loss_fn is not None:
            raise ConfigError(
                "--cp cuts each sequence before your loss_fn sees the labels, so a loss "
                "that shifts them would pair tokens across the cut. Train with the model's "
                "own loss (loss_fn=None), or pass (inputs, targets) pairs whose targets are "
                "already shifted."
            )
        return ids

    def _same_everywhere(self, tokens: torch.Tensor) -> None:
        """Refuse, on every rank, context ranks that hold different batches (their sizes,
        or the sum of their tokens, differ): they would attend to each other's samples."""
        mine = torch.stack(
            [tokens.new_tensor(tokens.shape[0]).double(), tokens.new_tensor(tokens.shape[1])
             .double(), tokens.double().sum()]
        )  # fmt: skip
        everyone = [torch.empty_like(mine) for _ in range(self.cp)]
        dist.all_gather(everyone, mine, group=self.group)
        seen = [tuple(row.tolist()) for row in everyone]
        if len(set(seen)) > 1:
            sizes = ", ".join(f"{int(n)} x {int(t)}" for n, t, _ in seen)
            raise ConfigError(
                f"The {self.cp} context ranks of a sample hold different batches ({sizes} "
                "tokens, or other tokens): under --cp they must read the same samples and "
                "cut them. Use engine.dataloader, or shard your own loader by the "
                "data-parallel rank, not by the global rank."
            )

    def share(
        self, part: Any, loss_fn: LossFn | None, counter: LabelCounter | None
    ) -> torch.Tensor | None:
        """This rank's weight among the context ranks where its cut holds its own number of
        scored targets (a collective over them): a Hugging Face model's own loss over its
        labels, or integer targets some of which are ignored (-100); None where every
        token counts alike."""
        if counter is not None and counter.applies(part, loss_fn):
            return self.label_share(counter.count(part))
        if is_pair(part) and not part[1].is_floating_point():
            return self.label_share(part[1].ne(IGNORE_INDEX).sum())
        return None

    def _cut_dict(self, batch: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
        """A dict batch's ``input_ids`` (N, T) cut, with every tensor of the same first
        two dimensions (``labels``, ``token_type_ids``); a causal LM's labels shifted
        first (``shift_labels``: the label of the token after each one), which its own
        loss takes as they are."""
        ids = batch["input_ids"]
        whole = dict(batch)
        labels = whole.get("labels")
        if self.shifts_labels and isinstance(labels, torch.Tensor) and "shift_labels" not in whole:
            whole["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return {
            key: value.index_select(1, index)
            if isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape
            else value
            for key, value in whole.items()
        }

    def _held(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the indices of the tokens this rank holds along dimension 1, their positions
        (N, T / cp)) for sequences of `tokens`' length."""
        t = tokens.shape[1]
        if t % (2 * self.cp):
            raise ConfigError(
                f"--cp {self.cp} cuts each sequence into {2 * self.cp} equal chunks, which "
                f"a sequence of {t} tokens does not divide into; use sequences of a multiple "
                f"of {2 * self.cp} tokens."
            )
        c = t // (2 * self.cp)
        index = torch.cat(
            [torch.arange(j * c, (j + 1) * c) for j in held_chunks(self.cp, self.rank)]
        ).to(tokens.device)
        return index, index.unsqueeze(0).expand(tokens.shape[0], -1)

    def label_share(self, count: torch.Tensor) -> torch.Tensor:
        """The weight of this rank's mean loss over its `count` labels, such that the mean
        over the context ranks of the weighted losses is the mean over all their labels
        (a collective over the context ranks)."""
        total = count.detach().clone()
        dist.all_reduce(total, group=self.group)
        return count * self.cp / total

    @contextlib.contextmanager
    def attending(self, positions: torch.Tensor) -> Iterator[None]:
        """Inside this block (a step's forward and backward, whose recomputed activations
        attend too) the model's attention sees the whole sequence (see the module's
        docstring) and `call` tells it the `positions` of its cut's tokens; a model that
        attended nothing through ``F.scaled_dot_product_attention`` is refused by name."""
        self._positions = positions
        try:
            with self.attention.installed(), self._switch():
                yield
        finally:
            self._positions = None

    def call(self, model: Callable[..., Any]) -> Callable[..., Any]:
        """`model` called with the positions of the step's cut as ``position_ids``."""
        return functools.partial(model, position_ids=self._positions)
