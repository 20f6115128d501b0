"""Guard semantics for loops nanprobe does not run: the Lightning and transformers callbacks, `nanprobe watch`.

:class:`HookedGuard` (``hooked.py``) is driven by a framework's hooks; ``events.py`` holds what it
reports and the pieces its users share.
"""

from .events import POLICIES, HookEvent, Stopped, check_policy, resolve_config, shown, skip_update, total_norm, unscaled
from .hooked import HookedGuard

__all__ = ["HookedGuard", "HookEvent", "Stopped", "POLICIES", "skip_update", "unscaled", "total_norm", "check_policy",
           "resolve_config", "shown"]
