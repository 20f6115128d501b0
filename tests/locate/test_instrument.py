"""OriginTracker: the producer, not the propagator; forward, backward and update; real model shapes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanprobe.base.config import load_config
from nanprobe.base.precision import Precision
from nanprobe.reach.replay import reach
from nanprobe.base.report import Phase
from nanprobe.locate.rerun import resolve_backward_source, run_step
from nanprobe.reach.target import Target


def trace_of(model, loss_fn, batch, *, optimizer=None, precision=Precision.FP32):
    target = Target(model=model, loss_fn=loss_fn, batches=[batch], optimizer=optimizer, precision=precision)
    reached = reach(target, at=0, precision=precision, cfg=load_config().replay, where="test")
    trace = run_step(target, reached, precision, where="test")
    resolve_backward_source(target, reached, trace, where="test")
    return trace


class LogThenMul(nn.Module):
    def forward(self, x):
        y = torch.log(x)      # producer: -inf from finite 0
        return y * 2 + 1      # propagators


def test_producer_not_propagator_and_inf_counts():
    model = nn.Sequential(nn.Identity(), LogThenMul())
    x = torch.tensor([[1.0, 0.0], [2.0, 3.0]], requires_grad=False)
    t = trace_of(model, lambda m, b: m(b).sum() + 0 * sum(p.sum() for p in [torch.ones(1, requires_grad=True)]), x)
    e = t.origin
    assert (e.phase, e.module, e.op, e.kind) == (Phase.FORWARD, "1", "aten.log.default", "-inf")
    assert e.samples == (0,)
    assert e.source.endswith("test_instrument.py:" + str(LogThenMul.forward.__code__.co_firstlineno + 1))
    assert len([ev for ev in t.trace.events if ev.phase is Phase.FORWARD]) == 1


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):
        s = self.q(x) @ x.transpose(-1, -2)
        causal = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), diagonal=1)
        s = s + causal                              # intended -inf mask
        s = s.masked_fill(torch.zeros_like(s, dtype=torch.bool), float("-inf"))
        return torch.softmax(s, -1) @ x


def test_intended_minus_inf_masks_are_not_origins():
    torch.manual_seed(0)
    model = MaskedAttention()
    t = trace_of(model, lambda m, b: m(b).pow(2).mean(), torch.randn(2, 3, 4))
    assert t.trace.events == []
    assert t.finite


def test_fully_masked_row_is_a_softmax_origin():
    torch.manual_seed(0)

    class AllMasked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask):
            s = (self.lin(x) @ x.transpose(-1, -2)).masked_fill(~mask[:, None, :], float("-inf"))
            return torch.softmax(s, -1) @ x

    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1] = False
    t = trace_of(AllMasked(), lambda m, b: m(*b).mean(), (torch.randn(2, 3, 4), mask))
    e = t.origin
    assert (e.phase, e.module, e.op, e.kind) == (Phase.FORWARD, "", "aten._softmax.default", "nan")
    assert e.samples == (1,)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)
        self.ident = nn.Identity()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.ident(self.drop(self.lin(x)))


class Dist(nn.Module):
    def forward(self, a):
        return torch.sqrt((a ** 2).sum(-1))


def test_backward_origin_named_by_node_module_and_forward_line():
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": Block(), "dist": Dist()})
    x = torch.randn(4, 3)
    loss = lambda m, b: m["dist"](m["enc"](b) * torch.tensor([[1.0], [1.0], [0.0], [1.0]])).sum()  # noqa: E731
    t = trace_of(model, loss, x)
    e = t.origin
    assert (e.phase, e.module, e.node) == (Phase.BACKWARD, "dist", "SqrtBackward0")
    assert "torch.sqrt" in e.code
    assert t.record.loss == pytest.approx(t.record.loss)  # forward finite
    assert math.isfinite(t.record.loss)


@pytest.mark.parametrize("foreach", [False, True])  # CUDA defaults to the foreach (in-place list) kernels
def test_update_origin_names_parameter_lr_and_state(foreach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 2), nn.Flatten(), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=0.0, foreach=foreach)
    t = trace_of(model, lambda m, b: m(b).sum(), torch.tensor([[1, 2], [3, 1]]), optimizer=opt)
    e = t.origin
    assert (e.phase, e.module, e.parameter) == (Phase.UPDATE, "0", "0.weight")
    assert e.update_info["eps"] == 0.0 and e.update_info["lr"] == 0.01
    assert e.update_info["exp_avg_sq_zeros"] > 0


def test_in_place_op_producer_is_found():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x.clone()
            y.div_(torch.zeros_like(y))  # in-place producer
            return y

    model = nn.Sequential(nn.Linear(2, 2), InPlace())
    t = trace_of(model, lambda m, b: m(b).sum(), torch.ones(3, 2))
    assert (t.origin.module, t.origin.op) == ("1", "aten.div_.Tensor")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: dict


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 2)

    def forward(self, batch):
        h = self.bn(batch["x"])
        return Out(logits=self.lin(h), aux={"h": (h, h.exp())})


def test_dataclass_dict_outputs_and_buffers_are_traced_and_restored():
    torch.manual_seed(0)
    model = DictModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"x": torch.randn(5, 3), "meta": ["a", "b"]}
    t = trace_of(model, lambda m, b: F.cross_entropy(m(b).logits, torch.zeros(5, dtype=torch.long)), batch,
                 optimizer=opt)
    assert t.finite and t.trace.events == []
    assert {r.module for r in t.trace.ranges} >= {"bn", "lin", ""}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "rerun must restore weights and buffers"


def test_fp16_overflow_in_matmul_with_range_stats():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.fill_(60.0)
        model[1].weight.fill_(60.0)
    t = trace_of(model, lambda m, b: m(b).float().pow(2).mean(), torch.ones(2, 8), precision=Precision.FP16)
    e = t.origin
    assert e.phase is Phase.FORWARD and e.module == "1" and e.out_dtype == "float16" and "inf" in e.kind
    first = next(r for r in t.trace.ranges if r.module == "0")
    assert first.absmax == pytest.approx(480 + 0, rel=0.2) or first.absmax > 400


class ExpHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return torch.exp(self.lin(x))  # fp16 exp overflows above ~11.09


def _exp_target():
    torch.manual_seed(0)
    model = ExpHead()
    with torch.no_grad():
        model.lin.weight.fill_(6.0)
        model.lin.bias.zero_()
    return Target(model=model, loss_fn=lambda m, b: m(b).float().mean(), batches=[torch.ones(3, 2)],
                  precision="fp16")


@pytest.mark.parametrize("policy, overflow", [("native", True), ("cuda", False)])
def test_cuda_autocast_policy_is_emulated_on_cpu(policy, overflow):
    target = _exp_target()
    reached = reach(target, at=0, precision=Precision.FP16, cfg=load_config().replay, where="t", policy=policy)
    t = run_step(target, reached, Precision.FP16, where="t")
    if overflow:
        assert (t.origin.op, t.origin.out_dtype, t.origin.kind) == ("aten.exp.default", "float16", "+inf")
    else:  # exp ran in float32 as on CUDA: the forward is finite (the fp16 backward mm still overflows)
        assert math.isfinite(t.record.loss)
        assert all(e.phase is not Phase.FORWARD for e in t.trace.events)
    with torch.autocast("cpu", dtype=torch.float16):  # the emulation is scoped to the rerun
        assert torch.softmax(torch.ones(2, 2) @ torch.ones(2, 2), -1).dtype == torch.float16


def test_fp16_matmul_emulation_matches_cpu_fp16_and_keeps_the_users_op_name():
    """compare-precisions' fp16 what-ifs on CPU: fp16 inputs times float32 arithmetic, rounded to fp16.
    The values match CPU's own fp16 kernels (which also accumulate in float32) up to summation order,
    and an overflow is still born at the user's op (the emulation sits below the tracker)."""
    from nanprobe.base.precision import emulate_fp16_matmuls

    torch.manual_seed(0)
    a, b = torch.randn(4, 32, 64).half(), torch.randn(4, 64, 48).half()
    native = a @ b
    with emulate_fp16_matmuls():
        emulated = a @ b
        lin = F.linear(torch.randn(8, 64).half(), torch.randn(16, 64).half())
    assert emulated.dtype == lin.dtype == torch.float16
    ulp = torch.finfo(torch.float16).eps * native.abs().float().clamp(min=1)
    assert ((emulated.float() - native.float()).abs() <= ulp).all()

    class Scores(nn.Module):
        def forward(self, q):
            return (q @ q.transpose(-2, -1)).float().mean()   # |q.q| reaches 1e5 > 65504 in fp16

    model = nn.Sequential(nn.Linear(8, 8), Scores())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8) * 60)
        model[0].bias.zero_()
    x = torch.full((2, 3, 8), 2.0)
    target = Target(model=model, loss_fn=lambda m, b: m(b), batches=[x], precision=Precision.FP32)
    reached = reach(target, at=0, precision=Precision.FP32, cfg=load_config().replay, where="test")
    trace = run_step(target, reached, Precision.FP16, where="test", emulate_fp16=True, tolerate_errors=True)
    e = trace.origin
    assert (e.phase, e.module, e.op, e.kind) == (Phase.FORWARD, "1", "aten.bmm.default", "+inf")
