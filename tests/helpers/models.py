"""The demo models the tests load (made on first use, one loaded copy per name) and the long
system prompt most warm agents share."""

from __future__ import annotations

from pathlib import Path

LONG_SYSTEM = (
    "You are a meticulous code reviewer for a python and rust server. Always read the tests first, "
    "then check every function and class for error handling, return values and file paths. "
    "Explain each fix briefly, list the steps, and never answer without checking the data. "
) * 3

# name -> (arch, template, quantize_bits)
MODEL_SPECS = {
    "dense": ("dense", "chatml", None),
    "hybrid": ("hybrid", "chatml", None),
    "sliding": ("sliding", "chatml", None),
    "dense-q4": ("dense", "chatml", 4),
    "mistral": ("dense", "mistral", None),
    "default-system": ("dense", "default-system", None),
}


class DemoModels:
    """Makes each demo model on first use and keeps one loaded copy per name."""

    def __init__(self, root: Path):
        self.root = root
        self._loaded = {}

    def path(self, name: str) -> Path:
        from kvsnap.tools.demo import DemoSpec, make_demo_model

        arch, template, bits = MODEL_SPECS[name]
        return make_demo_model(
            self.root / name, DemoSpec(arch=arch, template=template, quantize_bits=bits)
        )

    def load(self, name: str, **settings):
        from kvsnap.key import KVSettings
        from kvsnap.runtime.model.loading import load_model

        key = (name, tuple(sorted(settings.items())))
        if key not in self._loaded:
            self._loaded[key] = load_model(self.path(name), KVSettings(**settings))
        return self._loaded[key]
