"""Data the zoo's programs make or take from an installed package (nothing is downloaded at run time)."""

from __future__ import annotations

import torch


def digits(size: int = 8, normalize: tuple[float, float] = (0.1307, 0.3081)) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes) as (N, 1, size, size)
    floats in [0, 1] normalised like MNIST, and int64 labels. Needs the ``zoo`` extra (scikit-learn)."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - normalize[0]) / normalize[1]
    return x, torch.tensor(d.target, dtype=torch.int64)


def char_corpus(n_chars: int = 20000, seed: int = 0) -> str:
    """A deterministic English-like text made here: sentences from a small grammar (for language models)."""
    import random
    rng = random.Random(seed)
    nouns = ["model", "network", "gradient", "layer", "token", "batch", "optimizer", "loss", "weight", "head",
             "river", "city", "garden", "teacher", "student", "engine", "signal", "window", "market", "story"]
    verbs = ["learns", "updates", "predicts", "follows", "reads", "writes", "scales", "breaks", "finds", "keeps"]
    adjs = ["small", "large", "quiet", "noisy", "bright", "stable", "sharp", "slow", "fast", "deep"]
    out: list[str] = []
    size = 0
    while size < n_chars:
        s = f"the {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}"
        if rng.random() < 0.5:
            s += f" and the {rng.choice(nouns)} {rng.choice(verbs)} a {rng.choice(adjs)} {rng.choice(nouns)}"
        s += ". "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]
