"""mlx-lm's loaded model modules: where the attention routers rebind ``scaled_dot_product_attention``.

Every mlx-lm model module imports the function from ``mlx_lm.models.base`` under that name, so a
router takes a model's attention calls by replacing the module's own binding; no mlx-lm file changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from mlx_lm.models import base


def model_modules(include_base: bool = False) -> Iterator:
    """Each imported ``mlx_lm.models.*`` module that binds ``scaled_dot_product_attention``."""
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("mlx_lm.models.") and (include_base or name != base.__name__) \
                and hasattr(module, "scaled_dot_product_attention"):
            yield module


def rebind(old: Callable, new: Callable, include_base: bool = False) -> None:
    """Bind ``new`` in every model module whose attention is ``old``."""
    for module in model_modules(include_base):
        if module.scaled_dot_product_attention is old:
            module.scaled_dot_product_attention = new
