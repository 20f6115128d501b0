"""Step traces -> ranked findings. Small registered rules over one diagnosed step.

- ``core``: the op -> family registry, the ``Evidence`` bundle, ``classify`` (run every rule,
  merge per cause, rank), the honest low-confidence finding for an origin no rule knows;
- ``ops``: what inf/NaN means for loss and reduction ops (``register_semantics``);
- ``raised``: what an exception means when the user's step raised (``on_error``);
- ``rules``: data, divergence (step size), not reproduced, corrupted state, the origin op.
"""

from . import ops, raised, rules  # noqa: F401 - importing registers the rules
from .core import (RULES, Evidence, classify, family_of, node_base, op_base, register_family, rule,
                   scaler_skip_note)
from .ops import register_semantics, semantic_name, semantics_for
from .raised import explained_by, explains, on_error

__all__ = ["Evidence", "classify", "op_base", "node_base", "family_of", "register_family", "rule", "RULES",
           "register_semantics", "semantics_for", "semantic_name", "on_error", "explains", "explained_by",
           "scaler_skip_note"]
