"""`nanprobe scan-data`: every bad-data case is reported with its step, key path and samples."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import asset, example, output_lines
from nanprobe.judge.checks import DataProblem, check_batch, leaves
from nanprobe.surface.cli import app
from nanprobe.base.config import load_config
from nanprobe.reach.entry import load_target
from nanprobe.base.errors import EntryError, UsageError
from nanprobe.pipeline.scan import ScanResult, first_sample, infer_num_classes, scan_data
from nanprobe.reach.target import Target

runner = CliRunner()


def problems(result: ScanResult) -> list[tuple]:
    return [(p.step, p.level, p.code, p.key, p.samples) for p in result.problems]


def _sdpa_level(mask: torch.Tensor) -> str:
    """The oracle, independent of nanprobe: what SDPA (default backend choice) does for the mask's fully
    masked row on this torch. Output and gradient 0: a warning (only a hand-written softmax makes NaN)."""
    q = torch.randn(1, 1, mask.shape[-2], 4, requires_grad=True)
    k = v = torch.randn(1, 1, mask.shape[-1], 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    rows = ~mask.any(-1) if mask.dtype == torch.bool else (mask.amax(-1) == float("-inf"))
    harmless = bool(torch.isfinite(out).all()) and not bool(out[0, 0][rows].any()) and \
        bool(torch.isfinite(q.grad).all())
    return "warning" if harmless else "error"


BOOL_ROW = torch.tensor([[True, True], [False, False]])
FLOAT_ROW = torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]])
MASKED = _sdpa_level(BOOL_ROW)
MASKED_CODE = "masked_row" if MASKED == "error" else "masked_row_sdpa"

# -- each bad case: (entry, the whole list of problems) ---------------------------------------------
CASES = [
    ("scan_nan.py:target", [(3, "error", "nonfinite", "batch['x']", (2, 5))]),
    ("scan_labels.py:out_of_range", [(1, "error", "label_negative", "batch[1]", (2,)),
                                     (4, "error", "label_out_of_range", "batch[1]", (6,))]),
    ("scan_labels.py:all_ignored", [(2, "error", "all_ignored", "batch['labels']", ())]),
    ("scan_masks.py:attention_mask", [(1, MASKED, MASKED_CODE, "batch['attention_mask']", (3,))]),
    ("scan_masks.py:key_padding_mask", [(2, MASKED, MASKED_CODE, "batch['key_padding_mask']", (1,))]),
    ("scan_empty.py:target", [(2, "error", "empty", "batch.seqs", (4,))]),
    ("scan_fp16.py:target", [(2, "error", "beyond_range", "batch['features']", (7,))]),
    ("scan_warnings.py:target", [(9, "warning", "constant", "batch['x']", ()),
                                 (15, "warning", "outlier", "batch['x']", (3,))]),
    ("scan_warnings.py:early_outlier", [(1, "warning", "outlier", "batch['x']", (0,))]),
]


@pytest.mark.parametrize("entry, expected", CASES, ids=[c[0] for c in CASES])
def test_each_bad_case_reported_with_step_key_and_samples(entry, expected):
    result = scan_data(asset(entry))
    assert problems(result) == expected
    errors = any(level == "error" for _, level, *_ in expected)
    assert result.exit_code == (1 if errors else 0)
    assert result.status.value == ("nonfinite" if errors else "finite")


@pytest.mark.parametrize("entry", ["scan_clean.py:target", "scan_labels.py:lm_clean", "tiny.py:target"])
def test_clean_data_has_no_problem_and_exits_0(entry):
    result = scan_data(asset(entry))
    assert result.problems == () and result.problems_total == 0
    assert result.exit_code == 0 and result.errors == 0 and result.warnings == 0
    assert result.complete


def test_counts_values_and_messages():
    nan = scan_data(asset("scan_nan.py:target")).problems[0]
    assert nan.count == 2 and nan.value == float("inf") and "2 non-finite" in nan.message
    fp16 = scan_data(asset("scan_fp16.py:target")).problems[0]
    assert fp16.value == 1.0e5 and "65504" in fp16.message
    labels = scan_data(asset("scan_labels.py:out_of_range")).problems
    assert [p.value for p in labels] == [-1.0, 5.0]


def _with_scan(**changes):
    cfg = load_config()
    return dataclasses.replace(cfg, scan=dataclasses.replace(cfg.scan, **changes))


@pytest.mark.parametrize("every", [1, 4])
def test_summary_per_key(every):
    result = scan_data(asset("scan_clean.py:target"), config=_with_scan(moments_every=every))
    s = {k.key: k for k in result.summary}
    assert list(s) == ["batch['input_ids']", "batch['attention_mask']", "batch['labels']", "batch['features']",
                       "batch['scale']"]
    batches = load_target(asset("scan_clean.py:target")).target.batches
    feats = s["batch['features']"]
    data = torch.cat([b["features"].flatten() for b in batches])
    assert feats.role == "float" and feats.dtypes == ("float32",) and feats.batches == 30
    assert feats.shape_min == feats.shape_max == (8, 12, 3)
    assert feats.elements == data.numel()   # min/max and the checks see every batch
    assert feats.min == pytest.approx(float(data.min())) and feats.max == pytest.approx(float(data.max()))
    sampled = torch.cat([b["features"].flatten() for b in batches[::every]]).double()
    assert feats.moment_batches == len(batches[::every]) == (30 if every == 1 else 8)
    assert feats.mean == pytest.approx(float(sampled.mean()), rel=1e-4, abs=1e-6)
    assert feats.std == pytest.approx(float(sampled.std(correction=0)), rel=1e-4)
    labels = s["batch['labels']"]
    ignored = torch.cat([b["labels"].flatten() for b in batches[::every]])
    assert labels.role == "label" and labels.min >= 1 and labels.max <= 49
    assert labels.ignored_fraction == pytest.approx(float((ignored == -100).double().mean()))
    mask = s["batch['attention_mask']"]
    assert mask.role == "mask" and mask.mean == pytest.approx(1 - labels.ignored_fraction)
    assert s["batch['scale']"].std == 0.0   # constant by design, never varies: not a warning
    assert all(k.problems == {} for k in result.summary)


def test_summary_counts_problems_and_finite_stats():
    result = scan_data(asset("scan_nan.py:target"))
    x = next(k for k in result.summary if k.key == "batch['x']")
    assert x.problems == {"nonfinite": 1} and x.nonfinite == 2
    assert x.min is not None and abs(x.min) < 10 and abs(x.max) < 10   # over the finite values only
    empty = scan_data(asset("scan_empty.py:target"))
    seqs = next(k for k in empty.summary if k.key == "batch.seqs")
    assert seqs.ragged and seqs.shape_min[0] == seqs.shape_max[0] == 6 and seqs.shape_min[1] == 0


def test_precision_flag_overrides_the_target():
    assert scan_data(asset("scan_fp16.py:target"), precision="fp32").exit_code == 0
    result = scan_data(asset("scan_nan.py:target"), precision="fp16")
    assert result.precision == "fp16" and result.range_max == 65504.0


def test_num_classes_sources():
    inferred = scan_data(asset("scan_labels.py:out_of_range"))
    assert (inferred.num_classes, inferred.num_classes_source) == (3, "model output width")
    flag = scan_data(asset("scan_labels.py:out_of_range"), num_classes=10)   # 5 < 10: in range now
    assert (flag.num_classes, flag.num_classes_source) == (10, "--num-classes")
    assert [p.code for p in flag.problems] == ["label_negative"]
    loaded = load_target(asset("scan_labels.py:out_of_range"))
    loaded.target.num_classes = 5
    own = scan_data(loaded)
    assert (own.num_classes, own.num_classes_source) == (5, "target")
    assert [(p.step, p.code) for p in own.problems] == [(1, "label_negative"), (4, "label_out_of_range")]
    off = scan_data(asset("scan_labels.py:out_of_range"), config=_with_scan(infer_num_classes=False))
    assert off.num_classes is None and [p.code for p in off.problems] == ["label_negative"]


def test_output_width_below_the_labels_is_not_taken_as_num_classes():
    result = scan_data(asset("scan_labels.py:hidden_states"))
    assert result.num_classes is None and result.problems == () and result.exit_code == 0
    assert any("output width 4" in n for n in result.notes)


def test_inference_restores_mode_and_rng_and_never_runs_the_loss():
    loaded = load_target(asset("scan_labels.py:lm_clean"))
    model = loaded.target.model
    model.train()
    model.head.eval()   # a submodule the user froze stays as it was
    calls = []
    target = Target(model=model, batches=loaded.target.batches,
                    loss_fn=lambda m, b: calls.append(m(b["input_ids"])) or 1 / 0)
    rng = torch.get_rng_state()
    params = [p.detach().clone() for p in model.parameters()]
    batch = loaded.target.batches[0]
    assert infer_num_classes(target, batch) == 16
    assert calls == []   # stopped right after the model's forward: the loss never ran
    assert model.training and model.drop.training and not model.head.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert torch.is_grad_enabled()


def test_inference_failure_falls_back_silently():
    loaded = load_target(asset("scan_labels.py:lm_clean"))
    model = loaded.target.model
    target = Target(model=model, batches=loaded.target.batches, loss_fn=lambda m, b: m(b["missing"]))
    assert infer_num_classes(target, loaded.target.batches[0]) is None
    assert model.training


def test_first_sample_cuts_every_batch_sized_tensor():
    batch = {"ids": torch.zeros(4, 7), "shared": torch.ones(7, 7), "meta": "x", "pair": (torch.arange(4),)}
    cut = first_sample(batch)
    assert cut["ids"].shape == (1, 7) and cut["shared"].shape == (7, 7) and cut["pair"][0].tolist() == [0]
    assert cut["meta"] == "x"


def test_limit_and_progress():
    seen = []
    result = scan_data(asset("scan_warnings.py:target"), limit=5, on_progress=lambda *a: seen.append(a))
    assert result.batches_scanned == 5 and not result.complete
    assert seen == [(i, 5, 0) for i in range(1, 6)]
    full = scan_data(asset("scan_nan.py:target"), limit=6)
    assert full.batches_scanned == 6 and full.complete   # exactly the data
    with pytest.raises(UsageError, match="--limit -1"):
        scan_data(asset("scan_nan.py:target"), limit=-1)
    with pytest.raises(UsageError, match="--num-classes 0"):
        scan_data(asset("scan_nan.py:target"), num_classes=0)


def test_callable_batches_end_at_index_error():
    result = scan_data(asset("tiny.py:callable_batches"))
    assert result.batches_scanned == 5 and result.exit_code == 0
    assert any("IndexError" in n for n in result.notes)
    assert scan_data(asset("tiny.py:callable_batches"), limit=3).batches_scanned == 3


def test_scan_never_trains():
    loaded = load_target(asset("scan_nan.py:target"))
    before = [p.detach().clone() for p in loaded.target.model.parameters()]
    scan_data(loaded)
    assert all(torch.equal(a, b) for a, b in zip(before, loaded.target.model.parameters()))
    assert all(p.grad is None for p in loaded.target.model.parameters())


def test_bad_entry_raises_entry_error():
    with pytest.raises(EntryError):
        scan_data("nope.py:target")


# -- checks.py, as `run` uses it ---------------------------------------------------------------------
def test_check_batch_contract_for_run():
    batch = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 7, -100]), "attention_mask": torch.ones(4, 5)}
    batch["x"][2, 1] = float("nan")
    batch["x"][3, 0] = 7.0e4
    found = check_batch(batch, step=8, ignore_index=-100, num_classes=3, range_max=65504.0, max_examples=5)
    assert all(isinstance(p, DataProblem) and p.step == 8 for p in found)
    assert [(p.code, p.key, p.samples) for p in found] == [
        ("nonfinite", "batch['x']", (2,)), ("beyond_range", "batch['x']", (3,)),
        ("label_out_of_range", "batch['labels']", (2,))]
    assert check_batch({"x": torch.randn(3, 2)}) == []
    ignored = check_batch({"labels": torch.full((2, 3), -100)}, step=0)
    assert [p.code for p in ignored] == ["all_ignored"]
    assert found[0].to_json()["value"] == "nan"


def test_leaf_roles():
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long),
             "attention_mask": torch.ones(2, 3, dtype=torch.bool), "key_padding_mask": torch.zeros(2, 3).bool(),
             "loss_mask": torch.ones(2, 3), "bias_mask": torch.zeros(2, 3), "flags": torch.zeros(2).bool()}
    assert [(leaf.key, leaf.role) for leaf in leaves(batch)] == [
        ("batch['input_ids']", "int"), ("batch['labels']", "label"), ("batch['attention_mask']", "mask"),
        ("batch['key_padding_mask']", "pad_mask"), ("batch['loss_mask']", "float"),
        ("batch['bias_mask']", "float_mask"), ("batch['flags']", "bool")]
    assert [leaf.role for leaf in leaves((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))] == ["float", "label"]


def test_additive_float_mask_rows():
    mask = torch.zeros(3, 4)
    mask[:, 3] = float("-inf")      # intended -inf entries are not non-finite problems
    assert check_batch({"attn_mask": mask}) == []
    mask[1] = float("-inf")
    found = check_batch({"attn_mask": mask}, step=2)
    assert [(p.code, p.samples) for p in found] == [("masked_row" if _sdpa_level(FLOAT_ROW) == "error"
                                                     else "masked_row_sdpa", (1,))]
    bias = torch.zeros(3, 4)
    bias[2] = -1e9                  # fine in fp32 (uniform attention); -inf everywhere once cast to fp16
    assert check_batch({"attn_mask": bias}) == []
    found = check_batch({"attn_mask": bias}, range_max=65504.0)
    assert [(p.code, p.samples) for p in found] == [("masked_row", (2,))] and "65504" in found[0].message


def test_zero_length_and_empty_tensors():
    found = check_batch({"ids": torch.zeros(3, 0, dtype=torch.long), "w": torch.zeros(0)}, step=1)
    assert [(p.code, p.key, p.samples) for p in found] == [("empty", "batch['ids']", (0, 1, 2)),
                                                           ("empty", "batch['w']", ())]


# -- CLI ---------------------------------------------------------------------------------------------
def invoke(*args, env=None):
    return runner.invoke(app, list(args), env=env)


def test_cli_exit_codes():
    assert invoke("scan-data", asset("scan_clean.py:target")).exit_code == 0
    bad = invoke("scan-data", asset("scan_nan.py:target"))
    assert bad.exit_code == 1
    assert "step 3" in bad.output and "batch['x']" in bad.output and "nonfinite" in bad.output
    warn = invoke("scan-data", asset("scan_warnings.py:target"))
    assert warn.exit_code == 0 and "outlier" in warn.output


@pytest.mark.parametrize("args, fragment", [
    (["nope.py:target"], "file 'nope.py' not found"),
    ([asset("tiny.py") + ":missing"], "no function 'missing'"),
    ([asset("tiny.py") + ":raises"], "KeyError"),
    ([asset("scan_nan.py:target"), "--limit", "-1"], "--limit -1 is negative"),
    ([asset("scan_nan.py:target"), "--num-classes", "0"], "--num-classes 0"),
    ([asset("scan_nan.py:target"), "--precision", "fp8"], "unknown precision 'fp8'"),
])
def test_cli_bad_input_exits_2_with_one_line(args, fragment):
    result = invoke("scan-data", *args)
    assert result.exit_code == 2, result.output
    lines = output_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("nanprobe: error: ") and fragment in lines[0]
    assert "Traceback" not in result.output


def test_cli_json_stdout_is_only_json():
    result = invoke("scan-data", asset("scan_labels.py:out_of_range"), "--json", "-", "--limit", "5")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("schema", "command", "status", "device", "precision", "batches_scanned")} == {
        "schema": 1, "command": "scan-data", "status": "nonfinite", "device": "cpu", "precision": "fp32",
        "batches_scanned": 5}
    assert data["entry"].endswith("scan_labels.py:out_of_range") and data["nanprobe"]
    assert data["step"] == 1 and data["errors"] == 2 and data["complete"] is False
    assert data["problems"] == [
        {"code": "label_negative", "level": "error", "step": 1, "key": "batch[1]", "count": 1, "samples": [2],
         "value": -1.0, "message": "batch[1] holds 1 negative label(s) (e.g. -1) other than the ignore index -100; "
                                   'if your loss ignores -1, say so: "ignore_index": -1 in the target'},
        {"code": "label_out_of_range", "level": "error", "step": 4, "key": "batch[1]", "count": 1, "samples": [6],
         "value": 5.0, "message": "batch[1] holds 1 label(s) >= num_classes 3 (e.g. 5)"}]
    assert set(data["summary"]) == {"batch[0]", "batch[1]"}
    assert data["summary"]["batch[1]"]["problems"] == {"label_negative": 1, "label_out_of_range": 1}
    assert set(data["summary"]["batch[0]"]) >= {"dtype", "shape_min", "shape_max", "min", "max", "mean", "std",
                                                "problems"}


def test_cli_json_file_and_nonfinite_values(tmp_path):
    out = tmp_path / "scan.json"
    result = invoke("scan-data", asset("scan_nan.py:target"), "--json", str(out), "--precision", "fp16")
    assert result.exit_code == 1 and "batch['x']" in result.output   # the table still prints
    data = json.loads(out.read_text())   # strict JSON: inf is written as a string
    assert data["problems"][0]["value"] == "inf" and data["precision"] == "fp16" and data["range_max"] == 65504.0


def test_cli_quiet_without_a_terminal_or_in_ci():
    result = invoke("scan-data", asset("scan_clean.py:target"), "--json", "-", env={"CI": "true"})
    assert result.exit_code == 0 and "scanning" not in result.output
    json.loads(result.stdout)


@pytest.mark.parametrize("name, expected", [
    ("data_nan_features.py", [(3, "error", "nonfinite", "batch['x']", (5,))]),
    ("data_all_ignored.py", [(2, "error", "all_ignored", "batch.labels", ()),
                             (2, "warning", "constant", "batch.tokens", ())]),
])
def test_examples_point_at_the_step_and_sample_run_blames(name, expected):
    result = scan_data(example(name) + ":target")
    assert problems(result) == expected
    assert result.exit_code == 1


# -- the label fast paths and running statistics, on a Scanner directly -----------------------------
def _scanner(**changes):
    from nanprobe.pipeline.scan import Scanner
    return Scanner(_with_scan(**changes).scan, num_classes=10)


def test_label_paths_between_moment_batches():
    s = _scanner(moments_every=16)
    ok = torch.tensor([[3, 4, -100], [5, 6, -100]])
    s.add(0, {"labels": ok})                                         # exact path, counts ignored
    s.add(1, {"labels": torch.full((2, 3), 3)})                      # all equal to the fill value: not ignored
    s.add(2, {"labels": torch.tensor([[3, -1, -100], [4, 5, 6]])})   # -1 hides behind the ignore index
    s.add(3, {"labels": torch.tensor([[3, -200, -100], [4, 5, 6]])})  # below the ignore index
    s.add(4, {"labels": torch.tensor([[3, 4, -100], [4, 10, 6]])})   # >= num_classes
    s.add(5, {"labels": torch.full((2, 3), -100)})
    s.finish()
    assert [(p.step, p.code, p.samples, p.value) for p in s.problems] == [
        (2, "label_negative", (0,), -1.0), (3, "label_negative", (0,), -200.0),
        (4, "label_out_of_range", (1,), 10.0), (5, "all_ignored", (), -100.0)]
    summary = s.keys["batch['labels']"].summary()
    assert (summary.min, summary.max) == (-200, 10)
    assert summary.ignored_fraction == pytest.approx(2 / 6)   # from the moment batch (step 0) only
    assert summary.moment_batches == 1


def test_int_moments_are_exact_even_when_int64_squares_would_overflow():
    s = _scanner(moments_every=1)
    x = torch.arange(12).reshape(3, 4)
    for step, scale in enumerate([1, 1, 10 ** 9]):
        s.add(step, {"ids": x * scale})
    values = torch.cat([x.flatten(), x.flatten(), x.flatten() * 10 ** 9]).double()
    summary = s.keys["batch['ids']"].summary()
    assert summary.mean == pytest.approx(float(values.mean()))
    assert summary.std == pytest.approx(float(values.std(correction=0)))


class _Reiterable:
    """Re-iterable batches with no len(): each epoch iterates afresh."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("limit", [None, 6])
def test_scan_of_unsized_reiterable_batches_over_epochs(limit):
    import torch

    from nanprobe import Target
    from nanprobe.pipeline.scan import scan_data

    batches = [torch.ones(2, 3) for _ in range(4)]
    batches[2][1, 0] = float("nan")
    model = torch.nn.Linear(3, 1)
    target = Target(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    loss_fn=lambda m, b: m(b).sum(), batches=_Reiterable(batches), epochs=2)
    result = scan_data(target, limit=limit)
    assert [p.step for p in result.problems if p.code == "nonfinite"] == ([2, 6] if limit is None else [2])


def test_masked_row_checks_agree_with_what_sdpa_computes_here():
    """scan-data's verdict on a fully masked row is what F.scaled_dot_product_attention returns on this torch."""
    from nanprobe.judge.checks import sdpa_masked_row
    measured = sdpa_masked_row()
    assert "math" in measured["bool"] and measured["bool"]["math"] != "unavailable"
    for kind, mask in (("bool", BOOL_ROW), ("float", FLOAT_ROW)):
        level = _sdpa_level(mask)
        key = "attn_mask"
        found = check_batch({key: mask.unsqueeze(0).expand(2, 2, 2).clone()}, step=0)
        code = "masked_row" if level == "error" else "masked_row_sdpa"
        assert [(p.code, p.level) for p in found] == [(code, level)], (kind, found)
        if level == "warning":
            assert "returns 0 for such a row" in found[0].message and "hand-written softmax" in found[0].message


def test_a_padding_mask_named_pad_is_recognised():
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[1] = True                            # sample 1 is all padding
    found = check_batch({"ids": torch.ones(3, 4, dtype=torch.long), "pad": pad}, step=5)
    assert [(p.code, p.key, p.samples) for p in found] == [(MASKED_CODE, "batch['pad']", (1,))]
    assert check_batch({"pad": torch.zeros(3, 4, dtype=torch.bool)}) == []
