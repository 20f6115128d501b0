"""Capsules: one training step, saved so that `nanprobe run --capsule FILE` replays it exactly.

A capsule is a ``torch.save`` file holding only what ``torch.load(weights_only=True)`` accepts
(tensors, dicts, lists, tuples, Python numbers and strings), so a capsule from a colleague can
never run code. It holds the model, every optimizer, scheduler and GradScaler state *before* the
step, every micro-batch of the step (nested containers encoded as tagged dicts and rebuilt on
load) with the RNG states at the step's start and after each micro-batch was fetched, the state
the step carries between calls, the step number and its place in the data, the precision, the
recent loss / grad-norm / LR history, versions, and a model fingerprint (parameter names and
shapes) that tells a capsule from another model apart.

Size: the state's bytes plus the step's batches: about 12 bytes per parameter for fp32 weights with
Adam/AdamW (4 for the weights, 8 for the two moments), 4 with plain SGD, 8 with SGD + momentum.
Writing streams each tensor from its own memory (CUDA tensors through host memory one at a time);
reading maps the file, so neither holds a second full copy of the state.

Under FSDP2, FSDP1 or DDP (several ranks) a capsule is a directory every rank writes into, the tensors
through torch.distributed.checkpoint: see :mod:`nanprobe.capsule.sharded`.
"""

from .codec import compiled_graphs, decode_batch, encode_batch, fingerprint, rng_from_safe, rng_to_safe, safe_value, unwrap
from .io import (FORMAT, SUFFIX, Capsule, build, carried_attrs, list_capsules, no_room, prune, read, record_dict,
                 replay_command, report_stem, to_record, write)
from . import sharded
from .restore import build_from_reached, capsule_reach, check_model, reach_from_capsule

__all__ = ["Capsule", "build", "write", "read", "check_model", "reach_from_capsule", "capsule_reach",
           "list_capsules", "fingerprint", "encode_batch", "decode_batch", "rng_to_safe", "rng_from_safe",
           "safe_value", "unwrap", "record_dict", "to_record", "replay_command", "report_stem", "no_room", "prune", "carried_attrs",
           "build_from_reached", "compiled_graphs", "sharded", "FORMAT", "SUFFIX"]
