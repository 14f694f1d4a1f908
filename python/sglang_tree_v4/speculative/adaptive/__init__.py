"""The adaptive speculation budget: the tree shape (or no speculation) for each decode step.

``config`` (the tunables, ``PolicyConfig``), ``acceptance`` (acceptance per shape), ``timing`` (the step-time model),
``measure`` (its startup measurement and cache), ``lockstep`` (what speculating costs a batch outside its rounds),
``policy`` (``AdaptivePolicy``, the choice). Why each tunable has its value: ``docs/adaptive_budget.md``.
"""

from .config import DEFAULT, PolicyConfig
from .policy import NO_SPECULATION, AdaptivePolicy

__all__ = ["DEFAULT", "NO_SPECULATION", "AdaptivePolicy", "PolicyConfig"]
