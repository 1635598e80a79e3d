"""torchvision.transforms' Compose, Resize, CenterCrop, RandomCrop, RandomHorizontalFlip, Lambda,
ToTensor, PILToTensor, ConvertImageDtype and Normalize (see the package's docstring)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PIL = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.NEAREST_EXACT: Image.NEAREST,
        InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC,
        InterpolationMode.BOX: Image.BOX, InterpolationMode.HAMMING: Image.HAMMING,
        InterpolationMode.LANCZOS: Image.LANCZOS}


def _size(img: Any) -> tuple[int, int]:
    """(width, height) of a PIL image or a (..., H, W) tensor."""
    if isinstance(img, torch.Tensor):
        return img.shape[-1], img.shape[-2]
    return img.size


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img


class Lambda:
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, img: Any) -> Any:
        return self.fn(img)


class Resize:
    """The shorter side to `size` (an int), the aspect ratio kept; or exactly (h, w)."""

    def __init__(self, size: int | Sequence[int],
                 interpolation: InterpolationMode = InterpolationMode.BILINEAR) -> None:
        self.size, self.interpolation = size, interpolation

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        if isinstance(self.size, int):
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.size, int(self.size * long / short)
            new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        else:
            new_h, new_w = self.size
        return img.resize((new_w, new_h), _PIL[self.interpolation])


def _crop(img: Any, top: int, left: int, h: int, w: int) -> Any:
    if isinstance(img, torch.Tensor):
        return img[..., top:top + h, left:left + w]
    return img.crop((left, top, left + w, top + h))


class CenterCrop:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def corner(self, spare_h: int, spare_w: int) -> tuple[int, int]:
        """(top, left) of the crop, given the rows and columns it leaves out."""
        return round(spare_h / 2.0), round(spare_w / 2.0)

    def __call__(self, img: Any) -> Any:
        w, h = _size(img)
        th, tw = self.size
        return _crop(img, *self.corner(h - th, w - tw), th, tw)


class RandomCrop(CenterCrop):
    def corner(self, spare_h: int, spare_w: int) -> tuple[int, int]:
        top = int(torch.randint(0, spare_h + 1, size=(1,)).item())
        return top, int(torch.randint(0, spare_w + 1, size=(1,)).item())


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, img: Any) -> Any:
        if torch.rand(1) < self.p:
            return img.flip(-1) if isinstance(img, torch.Tensor) else img.transpose(Image.FLIP_LEFT_RIGHT)
        return img


class PILToTensor:
    def __call__(self, img: Image.Image) -> torch.Tensor:
        array = np.array(img, copy=True)
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class ToTensor:
    def __call__(self, img: Image.Image) -> torch.Tensor:
        return PILToTensor()(img).float().div(255)


class ConvertImageDtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if img.dtype == torch.uint8 and self.dtype.is_floating_point:
            return img.to(self.dtype).div(255)
        return img.to(self.dtype)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = list(mean), list(std)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=img.dtype).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=img.dtype).view(-1, 1, 1)
        return (img - mean) / std
