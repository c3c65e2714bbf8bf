"""What a newcomer meets first: the ImportError of a backend whose library is missing names a
fallback that works where they are (Python or Megatron's command line) and says which backend
the command line cannot name; the install requirements hold what Megatron's checkpoint save of
the layer imports."""

import importlib
import os
import re
import sys
import tomllib

import pytest

from megatron_moe_ext.utils import optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def missing(monkeypatch):
    """`require` of these modules fails as on a machine without them."""

    def hide(*names):
        real = importlib.import_module

        def fake(name, *args, **kwargs):
            if name in names:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return real(name, *args, **kwargs)

        for name in names:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(importlib, "import_module", fake)

    return hide


def test_deepep_import_error_spells_the_torch_backend_for_python_and_the_command_line(missing):
    missing("deep_ep")
    with pytest.raises(ImportError) as info:
        optional.require("deep_ep", "moe_flex_dispatcher_backend='deepep'")
    message = str(info.value)
    assert "TokenDispatcherConfig(moe_flex_dispatcher_backend='torch')" in message, message
    # Megatron's --moe-flex-dispatcher-backend takes deepep/hybridep/ncclep only.
    assert "--moe-token-dispatcher-type alltoall" in message, message


def test_uccl_import_error_says_the_command_line_cannot_choose_it(missing):
    missing("uccl.ep", "uccl")
    with pytest.raises(ImportError) as info:
        optional.require("uccl.ep", "moe_flex_dispatcher_backend='uccl_ep'")
    message = str(info.value)
    assert "--moe-flex-dispatcher-backend cannot name it" in message, message
    assert "TokenDispatcherConfig(moe_flex_dispatcher_backend='uccl_ep')" in message, message
    assert "--moe-token-dispatcher-type alltoall" in message, message


def test_megatron_cannot_name_uccl_ep_on_its_command_line():
    """What the uccl message above claims, read from Megatron's own config (its argparse
    choices come from this Literal)."""
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    choices = typing.get_args(typing.get_type_hints(TransformerConfig)["moe_flex_dispatcher_backend"])
    assert "uccl_ep" not in choices and "torch" not in choices, choices


def _install_requires() -> list[str]:
    """The package's PEP 621 dependencies, names only."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    return [re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0] for requirement in dependencies]


def test_install_requires_what_megatrons_checkpoint_save_imports():
    """Megatron's torch_dist save (filesystem_async) raises without psutil, which megatron-core
    does not require: saving a model with this package's layer needs it installed."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert hasattr(filesystem_async, "HAVE_PSUTIL"), "Megatron's save no longer guards psutil: recheck"
    assert "psutil" in _install_requires()
    assert "psutil" in open(os.path.join(ROOT, "requirements", "test.txt")).read().split()
