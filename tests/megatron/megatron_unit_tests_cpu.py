"""A pytest plugin for a generated copy of Megatron-LM's MoE unit tests on CPU gloo ranks
(tests/megatron/test_megatron_unit_tests.py generates the copy and starts the ranks).

Megatron's tests expect CUDA and NCCL: `Utils.initialize_distributed` sets the CUDA device and
starts an NCCL group, and the tests move modules and tensors with `.cuda()`. Here:
- tests/shims/megatron_cpu.py is installed (loaded by file path: in this run the package name
  `tests` is Megatron's);
- `Utils.initialize_distributed` starts a gloo group on torchrun's environment instead;
- `Tensor.cuda()` and `Module.cuda()` leave the object on the CPU;
- each rank writes its own pytest_stream_report file ($PYTEST_STREAM_REPORT.rank<N>).
"""

import importlib.util
import os

import torch
import torch.distributed as dist


def _load_shims():
    repo = os.environ["MOE_EXT_REPO"]
    spec = importlib.util.spec_from_file_location(
        "moe_ext_megatron_cpu", os.path.join(repo, "tests", "shims", "megatron_cpu.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    from tests.unit_tests.test_utilities import Utils

    _load_shims().install()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self

    def initialize_distributed():
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    if os.environ.get("PYTEST_STREAM_REPORT"):
        os.environ["PYTEST_STREAM_REPORT"] += f".rank{os.environ.get('RANK', '0')}"
