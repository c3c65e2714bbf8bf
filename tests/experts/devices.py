"""Devices the experts tests run on: the CPU always (CI), CUDA too where there is a GPU."""

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
