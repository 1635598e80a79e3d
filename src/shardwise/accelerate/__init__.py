"""The Accelerate-compatible surface: `Accelerator` (an `Engine` under Accelerate's names and
rules), Accelerate's configuration objects and state (`objects`), its rules as `LoopRules`
(`rules`), calls made on one process alone and the save/load hooks (`hooks`), the process
helpers (`process`) and the logger and profiler (`extras`)."""

from .accelerator import Accelerator as Accelerator
