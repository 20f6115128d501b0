"""`nanprobe watch -- python train.py ARGS`: an unmodified script under the guard, through PyTorch's global hooks.

The script runs in this process (``runpy``, ``sys.argv`` as it would see it), its output and exit
code untouched. While it runs (:mod:`.watcher`):

* the first optimizer that steps is the guarded one; its steps are the step numbers (0, 1, ...);
* during the first step, global module forward hooks find the *root module*: the outermost module
  called with gradients enabled whose parameters hold the optimizer's (DDP: the module inside);
  from then on only the root carries hooks: its inputs (by reference), the RNG state and the autocast
  dtype at each call, and the loss its output holds (``loss``, ``out.loss``, ``out["loss"]``, the one
  scalar in a tuple);
* the guarded optimizer's step pre-hook (or ``GradScaler.step``, after unscaling) checks the step: the
  loss and the global gradient norm in one device sync. A bad step's update is skipped (gradients set to
  None) and a capsule written; once the step is over it is diagnosed in-process with what needs no
  ``loss_fn``: the root's forward (and backward, when the output holds the loss) rerun on the captured
  inputs under instrumentation, the non-finite gradients by module, the data checks on the inputs and the
  update's forensics. The JSON report goes to ``dirpath`` (and ``--json OUT``); the log line names the
  ``nanprobe run ENTRY --capsule ...`` command for a full diagnosis with the script's own loss.

A closure optimizer (``LBFGS``) is checked at its closure's first evaluation, before any update. An
update that made weights non-finite is reported at its own step; such weights cannot be recovered by
skipping: that raises into the script (as policy ``raise`` does). Copies and pickles of the root module
(``copy.deepcopy``, ``AveragedModel``, ``torch.save(model)``) carry inert stand-ins for its hooks. A
sharded (FSDP2) model is not rerun in-process.

Any other command (``torchrun ...``, ``accelerate launch ...``, ``bash run.sh``) runs as a subprocess
whose Python processes are followed (:mod:`.launch`). A bad step the in-process diagnosis does not locate
(born in backward or in the update) is explained by ``nanprobe watch --at N`` (:mod:`.at`).
"""

from ..reach.forward import ForwardStep, find_loss
from .run import WatchResult, parse_command, watch
from .watcher import POLICIES, Watcher

__all__ = ["watch", "WatchResult", "Watcher", "ForwardStep", "find_loss", "parse_command", "POLICIES"]
