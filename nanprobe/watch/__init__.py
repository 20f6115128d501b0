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

A closure optimizer (``LBFGS``) gets a wrapped closure through the step pre-hook: its first evaluation
is the step's, checked before any update (a bad step's gradients are dropped there, so LBFGS stops
and the others skip). After each checked update the weights flag (``nanprobe.judge.updates``) is queued and
read in the next check's sync (or when the script ends): an update that made weights non-finite is
reported at its own step, with the parameter, LR and optimizer state. Such weights cannot be recovered
by skipping: that raises into the script (as policy ``raise`` does).

Any other command (``torchrun ...``, ``accelerate launch ...``, ``python -m torch.distributed.run ...``,
``bash run.sh``) runs as a subprocess whose Python processes are followed: each inherits a bootstrap
(``sitecustomize`` on ``PYTHONPATH``) that starts this same Watcher at the process's first optimizer and
writes a row per process at exit (:mod:`nanprobe.watch.launch`).

The root module carries two hooks; copies and pickles of it (``copy.deepcopy``, ``AveragedModel``,
``torch.save(model)``) carry inert stdlib stand-ins. A sharded (FSDP2) model is not rerun in-process.

A bad step whose origin the in-process diagnosis does not locate (born in backward or in the update) is
explained by ``nanprobe watch --at N -- python train.py ARGS`` (:mod:`nanprobe.watch.at`): the script
re-executed with step N instrumented, compared with the run record the watched run left in ``dirpath``.
"""

from ..reach.forward import ForwardStep, find_loss
from .run import WatchResult, parse_command, watch
from .watcher import POLICIES, Watcher

__all__ = ["watch", "WatchResult", "Watcher", "ForwardStep", "find_loss", "parse_command", "POLICIES"]
