"""Every private torch API the dry run uses (dryrun/torch_internals.py) still exists in this torch.

A failure reads "torch <version> changed <name>: <what breaks>"; the fence module's docstring says
what each internal is for.
"""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.dryrun import torch_internals


def test_every_private_api_the_dry_run_reaches_is_still_there():
    gone = torch_internals.missing()
    if gone:
        pytest.fail(f"torch {torch.__version__} changed: " + "; ".join(gone), pytrace=False)


@pytest.mark.parametrize("name", sorted(torch_internals.__all__))
def test_each_imported_private_name_is_bound(name):
    # the fence imports each name at its top: None only where the torch build lacks it (FakeStore)
    if name == "FakeStore" and torch_internals.FakeStore is None:
        pytest.fail(
            f"torch {torch.__version__} has no torch.testing._internal.distributed.fake_pg.FakeStore: "
            "dry runs need it for their fake process group",
            pytrace=False,
        )
    assert getattr(torch_internals, name) is not None, name


def test_missing_names_what_breaks(monkeypatch):
    # a moved attribute is reported with the feature it breaks, not as an AttributeError mid-run
    class Empty:
        pass

    monkeypatch.setattr(torch_internals, "ATTRIBUTES", [(Empty, "_gone", "the thing that breaks")])
    assert torch_internals.missing() == ["Empty._gone: the thing that breaks"]


def test_the_dry_run_reaches_private_torch_modules_only_through_the_fence():
    import ast
    from pathlib import Path

    package = Path(torch_internals.__file__).parent
    outside = []
    for path in sorted(package.glob("*.py")):
        if path.name == "torch_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("torch") and any(p.startswith("_") for p in module.split(".")):
                outside.append(f"{path.name}: from {module}")
    assert not outside, "import these through dryrun/torch_internals.py: " + "; ".join(outside)
