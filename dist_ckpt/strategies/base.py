"""Megatron-Core's ``strategies.base``: the strategy interfaces and the registry, one module.

Both live in their own modules here (``interfaces``: ``StrategyAction`` and the abstract
strategies with their call order; ``registry``: ``StrategyRegistry`` and the
``register_default_strategy`` / ``get_default_strategy`` functions), so that neither imports the
other's importer; this module gives Megatron-Core's path to all of their names.
"""

from . import interfaces as _interfaces
from . import registry as _registry
from .interfaces import *  # noqa: F401,F403
from .registry import *  # noqa: F401,F403

__all__ = _interfaces.__all__ + _registry.__all__
