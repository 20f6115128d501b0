"""`nanprobe watch -- python train.py ARGS`: an unmodified script under the guard, through PyTorch's global hooks.

The script runs in this process (``runpy``, ``sys.argv`` as it would see it), its output and exit
code untouched. While it runs:

* the first optimizer that steps is the guarded one; its steps are the step numbers (0, 1, ...);
* during the first step, global module forward hooks find the *root module*: the outermost module
  called with gradients enabled whose parameters hold the optimizer's (DDP: the module inside);
  from then on only the root carries hooks: its inputs (positional and keyword arguments, by
  reference), the RNG state and the autocast dtype at each call, and the loss its output holds
  (``loss``, ``out.loss``, ``out["loss"]``, the one scalar in a tuple);
* ``torch.autograd.backward`` notes the losses backpropagated (``GradScaler.scale`` the unscaled
  ones); ``LRScheduler.__init__`` notes the schedulers;
* the guarded optimizer's global step pre-hook (or ``GradScaler.step``, after unscaling) checks the
  step: the loss and the global gradient norm in one device sync. On a non-finite loss or gradient,
  or a spike, the update is skipped (gradients set to None) and a capsule written; once the step
  is over (the optimizer's post-hook) it is diagnosed in-process with what needs no ``loss_fn``:
  the root module's forward (and backward, when the output holds the loss) rerun on the captured
  inputs under instrumentation, the non-finite gradients by module, the data checks on the inputs,
  and the update's forensics (LR and optimizer settings; the parameters an earlier update made
  non-finite). The JSON report goes to ``dirpath`` (and ``--json OUT``); the log line names the
  ``nanprobe run ENTRY --capsule ...`` command for a full diagnosis with the script's own loss.

Weights an earlier update made non-finite cannot be recovered by skipping: that raises into the
script (as policy ``raise`` does).
"""

from .forward import ForwardStep, find_loss
from .run import WatchResult, parse_command, watch
from .watcher import POLICIES, Watcher

__all__ = ["watch", "WatchResult", "Watcher", "ForwardStep", "find_loss", "parse_command", "POLICIES"]
