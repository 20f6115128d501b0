"""The public surface is curated: __all__ matches the package's public names."""

import types

import nanprobe


def test_all_matches_public_names():
    public = {name for name, value in vars(nanprobe).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert set(nanprobe.__all__) - {"__version__"} == public


def test_exports_resolve():
    for name in nanprobe.__all__:
        assert getattr(nanprobe, name) is not None
