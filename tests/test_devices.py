"""Devices: drafters and target on different devices, caches over layers on several devices, device
arguments, CUDA stream ordering in the pipeline, and the attention switch of a model two threads share.

This machine has no second device, so the tests simulate one, and each fails without its fix:

* `OnOtherDevice`: a CPU tensor that says it lives on another device; an op mixing it with a tensor of
  the real one raises, as CUDA does, and `.to(the real device)` is the copy that brings it back.
* `StrictDevices`: a torch function mode that raises when one op mixes tensors of two devices (CUDA
  refuses a `gather` or an index from another GPU; meta and CPU tensors are more lenient), so cache
  layers on "meta" stand for layers on a second GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import hf_spin
from hf_spin.drafters import ModelDrafter

from .archs import ragged_batch
from .speculation import assert_speculated, pool as spin_pool

OTHER = torch.device("meta")  # the simulated second device


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


class OnOtherDevice(torch.Tensor):
    """A CPU tensor that reports `OTHER` as its device and refuses to meet tensors of the real device."""

    @property
    def device(self) -> torch.device:
        return OTHER

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:  # a copy to the real device brings it back; a dtype change keeps it here
            wanted = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
            if wanted is not None and torch.device(wanted) != OTHER:
                kwargs = {k: v for k, v in kwargs.items() if k != "device"}
                rest = [a for a in args[1:] if not isinstance(a, (torch.device, str))]
                return _plain(args[0]).to(*rest, **kwargs).clone()
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        real = [t for t in tensors if not isinstance(t, OnOtherDevice) and t.dim() > 0]
        if real:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two: {OTHER} (simulated) and {real[0].device}")
        return super().__torch_function__(func, types, args, kwargs)


class OtherDeviceDrafter(ModelDrafter):
    """A model drafter whose logits live on `OTHER` (a draft model on a second GPU)."""

    def _forward(self, chunks, keep):
        return super()._forward(chunks, keep).as_subclass(OnOtherDevice)


def spin(model, pool, **kwargs):
    return model.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)


def test_simulated_device_refuses_mixing():
    """The simulation itself: mixing raises, `.to` the real device comes back plain and equal."""
    x = torch.arange(4.0).as_subclass(OnOtherDevice)
    assert x.device == OTHER and float((x * 2).sum()) == 12.0
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(4)
    back = x.to("cpu")
    assert type(back) is torch.Tensor and torch.equal(back, torch.arange(4.0))
    assert isinstance(x.to(torch.float64), OnOtherDevice)


def test_drafter_on_another_device_keeps_speculating_under_processors(target, drafter):
    """The target's processors hold tensors on the target's device (min_new_tokens: eos ids;
    repetition_penalty: the ids); the drafter's logits are scored there, so it is not dropped."""
    ids, mask = ragged_batch(2, 8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, do_sample=False, repetition_penalty=1.3, min_new_tokens=10)
    pool = spin_pool([OtherDeviceDrafter(drafter)])
    assert torch.equal(spin(target, pool, **kwargs), target.generate(**kwargs))
    assert_speculated(pool.last_stats)  # no failure, multi-token drafts, accepted and rejected


def test_drafter_on_another_device_sampling_hands_q_to_the_target(target, drafter):
    """Sampled, q is drawn on the drafter's device (no processors) and verified on the target's."""
    ids, mask = ragged_batch(2, 8)
    pool = spin_pool([OtherDeviceDrafter(drafter)])
    out = spin(target, pool, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0)
    assert out.shape == (2, 8 + 12)
    assert_speculated(pool.last_stats, rejected=False)
