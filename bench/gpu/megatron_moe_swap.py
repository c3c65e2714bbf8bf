"""A pytest plugin that runs Megatron-LM's own MoE unit tests with this package's layer:

    pytest -p bench.gpu.megatron_moe_swap tests/unit_tests/transformer/moe/test_moe_layer.py ...

- `megatron_moe_ext.patches.apply()` at start-up: every MoE layer that Megatron's spec builders
  (`get_gpt_layer_local_spec`, `..._with_transformer_engine_spec`, `get_moe_module_spec`) make
  is `FlexMoELayer`, whose dispatcher is `MoEFlexTokenDispatcher` (torch backend for the
  alltoall / allgather tests, Megatron's backend name for the flex ones);
- every collected test module's global `MoELayer` (the tests that build the layer directly,
  `MoELayer(config, submodules)`) becomes `FlexMoELayer`, a subclass, so their `isinstance`
  checks still hold.
Megatron's test files are not modified or copied. At the end it writes
$MOE_SWAP_REPORT (JSON, rank 0 under torchrun): how many MoE layers of each class the tests
built, so a run that silently built Megatron's own layer shows it.
"""

import collections
import json
import os

_built = collections.Counter()


def pytest_configure(config):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_moe_ext.patches as patches

    patches.apply()
    original_init = MoELayer.__init__

    def counting_init(self, *args, **kwargs):
        _built[type(self).__name__] += 1
        original_init(self, *args, **kwargs)

    MoELayer.__init__ = counting_init


def pytest_collection_modifyitems(session, config, items):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if getattr(module, "MoELayer", None) is MoELayer:
            module.MoELayer = FlexMoELayer


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MOE_SWAP_REPORT")
    if path and os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            json.dump({"moe_layers_built": dict(_built)}, f)
