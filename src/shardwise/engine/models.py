"""The model verbs of `Engine`: models in (`init_empty`, `from_pretrained`, `load_model`) and
out (`unwrap_model`, `get_state_dict`, `save_model`), over the engine's `Session`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..checkpoint.storage import CheckpointError, agree
from ..distributed.arrival import arrived_together
from ..weights.adapters import FullWeights, save_problem, save_weights, unwrapped
from ..weights.ema import PreparedEMA, shard, whole_on_main
from ..weights.export import find_aliases
from ..weights.loading import Pretrained, check_source
from ..weights.materialize import init_empty
from .lone import LoneCalls
from .session import PRETRAINED, Session


class ModelVerbs:
    """Mixed into `Engine`, which provides `session` and `is_main_process`."""

    _init_rng: torch.Tensor | None  # init_empty(): the generator state it began with
    _pretrained_saves: dict[int, int]  # save_pretrained calls at the current step (arrival keys)
    noun: str  # what the user calls this object in messages: "engine" (or "accelerator")
    _emas: list[PreparedEMA]  # EMAs passed to prepare
    _lone: LoneCalls  # the main process's calls alone after a barrier, served by the others

    @property
    def session(self) -> Session:
        raise NotImplementedError

    @property
    def is_main_process(self) -> bool:
        raise NotImplementedError

    @property
    def num_processes(self) -> int:
        raise NotImplementedError

    @property
    def process_index(self) -> int:
        raise NotImplementedError

    @property
    def step(self) -> int:
        raise NotImplementedError

    @property
    def config(self) -> Any:
        raise NotImplementedError

    def others_moved_on(self) -> bool:
        raise NotImplementedError

    # -- models in ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_empty(self) -> Iterator[None]:
        """Build models inside without memory: parameters on the meta device (buffers stay real).

        `prepare` then allocates each process's shards only and initializes the weights with
        the model's own initializers, module by module; the result does not depend on the
        number of processes or the strategy (see `shardwise.weights.materialize`).
        """
        with init_empty() as record:
            yield
        self._init_rng = record.rng

    def load_model(self, model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
                   key_map: dict[str, str] | None = None) -> None:
        """Load safetensors weights into a prepared model: the inverse of `save_model`.

        `path`: a folder written by `save_model`, `shardwise export` or `save_pretrained`, or one
        `.safetensors` file. Keys, shapes and files are checked before any weight changes (`strict=False`
        leaves missing keys and skips unused ones, with a warning; `key_map={'old.': 'new.'}` renames key
        prefixes; a wrapper's `module.` is stripped). Each process reads its shard's rows. A collective.
        """
        strategy = self.session.strategy
        source, found = check_source(path, strategy.unwrap(model), strict=strict,
                                     shapes=strategy.full_shapes(model),
                                     key_map=key_map)
        self.session.load_weights(model, source, found)

    def from_pretrained(self, model_class: Any, path: str | os.PathLike[str], *, strict: bool = True,
                        key_map: dict[str, str] | None = None, **config_kwargs: Any) -> nn.Module:
        """A `transformers` model built from the config in `path` without memory; `prepare`
        then loads the weights in `path` into its shards (keys the files lack, such as a new
        classification head, are initialized by the model's own `_init_weights`).

        `model_class`: an `AutoModelFor...` class or a model class; `config_kwargs` override the config
        (`num_labels=2`); `strict`, `key_map` as in `load_model`. Reads local folders (no hub access).
        """
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **config_kwargs)
        with self.init_empty():
            model = (getattr(model_class, "from_config", None) or model_class)(config)
        object.__setattr__(model, PRETRAINED, Pretrained(Path(path), strict, key_map))
        return cast(nn.Module, model)

    def whole_emas(self) -> contextlib.AbstractContextManager[None]:
        """Inside, every EMA passed to `prepare` holds whole shadows on the main process (for
        save hooks that call its `save_pretrained` there alone). A collective: every process."""
        return whole_on_main(self._emas, self.is_main_process)

    def reshard_emas(self) -> None:
        """EMAs passed to `prepare` whose shadows a load hook replaced with whole tensors, cut
        back to their parameters' layout."""
        for prepared in self._emas:
            shard(prepared)

    # -- models out -------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module, without the DDP wrapper (an FSDP2 module is its own unwrap); its
        `save_pretrained` refuses while it is sharded: use `save_model` (see `adapters`)."""
        return unwrapped(self.session.strategy.unwrap(model))

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights as CPU tensors on the main process; `{}` on the others.
        Tied parameters are one tensor under each of their names, as in the model (so
        transformers' `save_pretrained` writes them once). A collective: call it on every process."""
        self._lone.common("get_state_dict")
        return self._whole_weights(model)

    def _whole_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`get_state_dict` inside a call (a save, a lone `save_pretrained` the others serve)."""
        state = self.session.strategy.full_state_dict(model)
        for alias, first in find_aliases(self.unwrap_model(model)).items():
            if first in state:
                state[alias] = state[first]
        return state

    def _full_weights(self, model: nn.Module) -> FullWeights:
        """Where the prepared `model`'s own save_pretrained gets its weights (`adapters`)."""

        def together() -> bool:
            index = self._lone.index(model)
            if index is not None and self._lone.maybe_alone(f"save_pretrained of model {index}",
                                                            lambda: ("gather", index)):
                return True  # after wait_for_everyone(): made together, or served by the others
            return arrived_together(self._pretrained_saves, "save_pretrained", self.step, self.num_processes,
                                    self.is_main_process, self.config.supervision.collective_timeout_s,
                                    self.others_moved_on)

        return FullWeights(lambda: self._whole_weights(model), together, self.noun, self.process_index)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "5GB",
                   *, merge_adapters: bool = False) -> None:
        """Consolidated weights as safetensors (split above `max_shard_size`, with an index),
        plus config.json for a `transformers` model: `from_pretrained(dir)` loads it. A peft
        model: its adapter folder (`PeftModel.from_pretrained`), or with `merge_adapters` the
        merged full model. Only those files are written or replaced; each is staged beside the
        folder and renamed in, the top file last; checksums: `shardwise verify DIR`. A collective.
        """
        self._lone.common("save_model")
        target = Path(save_directory)
        # checked (and agreed on) before the gather
        agree(save_problem(self.unwrap_model(model), target, merge_adapters, self.is_main_process))
        state = self._whole_weights(model)
        problem = None
        if self.is_main_process:
            try:
                save_weights(self.unwrap_model(model), state, target, max_shard_size=max_shard_size,
                             merge_adapters=merge_adapters)
            except CheckpointError as err:
                problem = str(err)
        agree(problem)
