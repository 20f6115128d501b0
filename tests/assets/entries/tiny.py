"""A small healthy target used by unit tests (and as a base for broken variants)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def build(**overrides):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(5)]
    out = {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]), "batches": batches,
           "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    out.update(overrides)
    return out


def target():
    return build()


def with_config(config=None):
    config = config or {}
    return build(**({"max_grad_norm": config["clip"]} if "clip" in config else {}))


def takes_two(a, b):
    return build()


def raises():
    values = {}
    return values["missing"]  # KeyError raised in the user's code


def returns_none():
    return None


def returns_list():
    return [1, 2]


def no_model():
    t = build()
    del t["model"]
    return t


def model_not_module():
    return build(model="not a model")


def unknown_key():
    return build(lr=0.1)


def loss_not_scalar():
    return build(loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))


def loss_not_tensor():
    return build(loss_fn=lambda m, b: 1.0)


def loss_detached():
    return build(loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]).detach())


def loss_raises():
    def loss_fn(m, b):
        return F.cross_entropy(m(b[0][:, :3]), b[1])  # wrong width: the user's shape bug
    return build(loss_fn=loss_fn)


def bad_precision():
    return build(precision="fp8")


def scaler_without_fp16():
    return build(grad_scaler=True)


def one_shot_batches():
    t = build()
    t["batches"] = iter(t["batches"])
    return t


def foreign_optimizer():
    other = nn.Linear(2, 2)
    return build(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def callable_batches():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(5)]
    return build(batches=lambda step: data[step])


def not_callable_entry():
    pass


NOT_A_FUNCTION = 3
