"""torchvision.transforms.functional's `pil_to_tensor` (transformers' image utilities import it
when they find a torchvision)."""

from __future__ import annotations

from typing import Any

import torch

from . import PILToTensor


def pil_to_tensor(pic: Any) -> torch.Tensor:
    return PILToTensor()(pic)
