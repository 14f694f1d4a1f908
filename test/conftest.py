"""Shared pytest setup: CPU tests run with one torch thread (two threads are far slower on small ops here)."""
import torch

torch.set_num_threads(1)
