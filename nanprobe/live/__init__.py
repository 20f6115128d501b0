"""Guard semantics for loops nanprobe does not run: the Lightning and transformers callbacks, `nanprobe watch`.

:class:`HookedGuard` (``hooked.py``) is driven by a framework's hooks; ``events.py`` holds what it
reports and the pieces its users share.
"""

from .events import (POLICIES, HookEvent, Stopped, check_policy, current_lr, distributed, grads_of,
                     resolve_config, shown, skip_update, total_norm)
from .hooked import HookedGuard

__all__ = ["HookedGuard", "HookEvent", "Stopped", "POLICIES", "skip_update", "grads_of", "total_norm",
           "current_lr", "distributed", "check_policy", "resolve_config", "shown"]
