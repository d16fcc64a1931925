"""Devices: drafters and target on different devices, caches over layers on several devices, device
arguments, CUDA stream ordering in the pipeline, and the attention switch of a model two threads share.

This machine has no second device, so the tests simulate one, and each fails without its fix:

* `OnOtherDevice`: a CPU tensor that says it lives on another device; an op mixing it with a tensor of
  the real one raises, as CUDA does, and `.to(the real device)` is the copy that brings it back.
* `StrictDevices`: a torch function mode that raises when one op mixes tensors of two devices (CUDA
  refuses a `gather` or an index from another GPU; meta and CPU tensors are more lenient), so cache
  layers on "meta" stand for layers on a second GPU.
* `FakeCuda`: torch.cuda's stream and event calls, logged, so the pipeline's stream ordering is checked
  on the CPU's code path.

The tests at the end run only where CUDA is: the same fixes on a real GPU (a side stream, a CPU drafter
for a CUDA target, a model split over the GPU and the CPU).
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
from .speculation import assert_speculated
from .speculation import pool as spin_pool

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
            raise RuntimeError(
                "Expected all tensors to be on the same device, "
                f"but found at least two: {OTHER} (simulated) and {real[0].device}"
            )
        return super().__torch_function__(func, types, args, kwargs)


class OtherDeviceDrafter(ModelDrafter):
    """A model drafter whose logits live on `OTHER` (a draft model on a second GPU)."""

    def _forward(self, chunks, keep):
        return super()._forward(chunks, keep).as_subclass(OnOtherDevice)


@pytest.fixture
def copies_to_other(monkeypatch):
    """Host data the drafter copies to its logits' device (row indices) lands on `OTHER` too, as a
    copy to the second GPU would."""
    import hf_spin.drafters.model as model_module

    real = model_module.to_device

    def to_device(data, device, dtype=None):
        if torch.device(device) == OTHER:
            return real(data, "cpu", dtype).as_subclass(OnOtherDevice)
        return real(data, device, dtype)

    monkeypatch.setattr(model_module, "to_device", to_device)


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


def test_drafter_on_another_device_keeps_speculating_under_processors(target, drafter, copies_to_other):
    """The target's processors hold tensors on the target's device (min_new_tokens: eos ids;
    repetition_penalty: the ids); the drafter's logits are scored there, so it is not dropped."""
    ids, mask = ragged_batch(2, 8)
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=15,
        do_sample=False,
        repetition_penalty=1.3,
        min_new_tokens=10,
    )
    pool = spin_pool([OtherDeviceDrafter(drafter)])
    assert torch.equal(spin(target, pool, **kwargs), target.generate(**kwargs))
    assert_speculated(pool.last_stats)  # no failure, multi-token drafts, accepted and rejected


def test_drafter_on_another_device_sampling_hands_q_to_the_target(target, drafter, copies_to_other):
    """Sampled, q is drawn on the drafter's device (no processors) and verified on the target's."""
    ids, mask = ragged_batch(2, 8)
    pool = spin_pool([OtherDeviceDrafter(drafter)])
    out = spin(target, pool, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0)
    assert out.shape == (2, 8 + 12)
    assert_speculated(pool.last_stats, rejected=False)


# -- caches over layers on several devices (device_map) ------------------------------------------------


class StrictDevices(TorchFunctionMode):
    """Raises when one op mixes tensors of two devices (0-dim CPU scalars aside), as CUDA does for a
    gather or an index from another GPU; `.to` and `copy_` are the moves between devices."""

    MOVES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.MOVES:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
            if len(devices) > 1:
                raise RuntimeError(
                    f"{getattr(func, '__name__', func)} mixes tensors of devices {sorted(map(str, devices))}"
                )
        return func(*args, **kwargs)


def test_strict_devices_refuses_an_index_from_another_device():
    keys = torch.zeros(2, 1, 3, 1, device=OTHER)
    with StrictDevices(), pytest.raises(RuntimeError, match="mixes tensors"):
        keys[torch.tensor([1])]


def _kv(B: int, S: int, device, start: float = 0.0) -> torch.Tensor:
    """[B, H=2, S, D=1]: slot s of row b holds start + 100 b + s."""
    t = start + 100 * torch.arange(B)[:, None, None, None] + torch.arange(S)[None, None, :, None]
    return t.expand(B, 2, S, 1).float().contiguous().to(device)


def test_ragged_cache_indexes_each_layer_on_its_device():
    """Layer 0 on the CPU, layer 1 on another device: compaction and retirement index each where it is."""
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    cache = hf_spin.cache.RectangularCache(mask)
    for i, device in enumerate(["cpu", OTHER]):
        cache.update(_kv(2, 4, device), _kv(2, 4, device, start=0.5), i)
    with StrictDevices():
        cache.compact()  # rows' valid slots to the right: src [[0 2 3], [0 0 2]]
    assert torch.equal(cache.layers[0].keys[:, 0, :, 0], torch.tensor([[0.0, 2, 3], [100, 100, 102]]))
    assert cache.layers[1].keys.device == OTHER and cache.layers[1].keys.shape == (2, 2, 3, 1)
    with StrictDevices():
        cache.select_rows(torch.tensor([1]))
    assert torch.equal(cache.layers[0].values[:, 0, :, 0], torch.tensor([[100.5, 100.5, 102.5]]))  # left holes stay
    assert cache.layers[1].keys.device == OTHER and cache.layers[1].keys.shape == (1, 2, 3, 1)
    assert cache.slot_mask.tolist() == [[False, False, True]]


def test_packed_cache_writes_and_relays_out_each_layer_on_its_device():
    cache = hf_spin.cache.PackedCache(2)
    meta, _ = cache.begin([2, 1])
    with StrictDevices():
        for i, device in enumerate(["cpu", OTHER]):
            kv = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1).to(device)  # [1, H_kv, total_q, D]
            cache.update(kv, kv + 0.5, i)
    cache.commit()
    assert cache.layers[1].keys.device == OTHER
    with StrictDevices():
        cache.select_rows(torch.tensor([1]))  # row 1 alone, compacted to slot 0
    assert cache.lengths == [1] and float(cache.layers[0].keys[0, 0, 0]) == 3.0
    assert cache.layers[1].keys.device == OTHER and cache.layers[1].keys.shape[0] == cache.total_slots


def test_varlen_metadata_follows_the_layer_device(monkeypatch):
    """A layer on another device reads the metadata there (one copy per device), under that device's
    CUDA context: Triton launches on the current device, not on the tensors'."""
    from hf_spin.kernels import attention

    meta = attention.VarlenMetadata.make_dummy([2, 1], [3, 2])
    moved = meta.on(OTHER)
    assert moved is meta.on(OTHER) and meta.on(torch.device("cpu")) is meta
    assert moved.cu_seqlens_k.device == OTHER and moved.max_seqlen_k == 3
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    def kernel(q, k, v, cu_q, cu_k, *args, seqused_k=None, tree_mask=None, **kwargs):
        assert entered and entered[-1] == q.device, "launched outside the device guard"
        for t in (k, v, cu_q, cu_k, seqused_k, tree_mask):
            assert t is None or t.device == q.device, f"a tensor on {t.device}, q on {q.device}"
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], device=q.device)

    monkeypatch.setattr(attention, "varlen_attention", kernel)
    monkeypatch.setattr(attention, "on_device", Guard)
    q = torch.zeros(1, 2, 3, 4, device=OTHER)  # [1, H, total_q, D]
    k = torch.zeros(1, 2, 5, 4, device=OTHER)  # [1, H_kv, total_k, D]
    out, _ = attention.varlen_attention_forward(torch.nn.Module(), q, k, k, None, spin_varlen=meta)
    assert out.shape == (1, 3, 2, 4) and entered == [OTHER, None]


def test_device_guard_is_the_tensors_cuda_device():
    from hf_spin.kernels.attention import on_device

    guard = on_device(torch.device("cuda", 1))  # made, not entered: no CUDA needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with on_device(torch.device("cpu")):
        pass


# -- device arguments: models.load(device=...), hf-spin serve --device ---------------------------------


@pytest.fixture
def cached_tiny(tmp_path, target):
    """A tiny llama saved where `models.load` finds a converted packaged model (no conversion runs)."""
    from hf_spin import models

    from .tiny_tokenizers import char_tokenizer

    name = "smollm2-135m-instruct"
    folder = models.cached_path(name, torch.float32, tmp_path)
    target.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return name, tmp_path


def test_load_places_the_model_on_the_device_given(cached_tiny, monkeypatch):
    from hf_spin import models

    name, cache = cached_tiny
    # a device map (accelerate): placed where accelerate sees devices, which a patched is_available does not hide
    model, _ = models.load(name, dtype=torch.float32, cache_dir=cache, device="auto")
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.default_device() == "cpu" and models.device_map(None) == "cpu"
    model, tok = models.load(name, dtype=torch.float32, cache_dir=cache)  # default: cpu without a GPU
    assert model.device.type == "cpu" and tok.padding_side == "left"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.device_map(None) == "cuda"


@pytest.mark.parametrize(
    "device, expected",
    [("cuda:1", torch.device("cuda", 1)), ("auto", "auto"), ("balanced", "balanced"), (None, "cuda")],
)
def test_load_passes_the_device_to_from_pretrained(cached_tiny, monkeypatch, device, expected):
    from transformers import AutoModelForCausalLM

    from hf_spin import models

    name, cache = cached_tiny
    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def from_pretrained(folder, **kwargs):
        seen.update(kwargs)
        return real(folder, dtype=kwargs["dtype"])  # no GPU here: load on the CPU, check what was asked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    models.load(name, dtype=torch.float32, cache_dir=cache, device=device)
    assert seen["device_map"] == expected


def test_load_refuses_an_unknown_device(cached_tiny):
    from hf_spin import models

    name, cache = cached_tiny
    with pytest.raises(ValueError, match=r"device='gpu0' is neither a device .* nor a device map \(auto"):
        models.load(name, dtype=torch.float32, cache_dir=cache, device="gpu0")


SERVE_EXTRA = "the serve extra is not installed (pip install 'hf_spin[serve]'); the test extra installs it"


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    "argv, expected", [([], None), (["--device", "cuda:1"], "cuda:1"), (["--device", "auto"], "auto")]
)
def test_serve_device_reaches_every_model(monkeypatch, argv, expected):
    """`hf-spin serve --device` is parsed and handed to the target's and each drafter's load."""
    import argparse

    pytest.importorskip("fastapi", reason=SERVE_EXTRA)

    from hf_spin.serving import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(argv + ["--model", "./t", "--drafter", "./d", "--drafter", "prompt_lookup"])
    assert args.device == expected
    loads = []

    def load_model(name, dtype, device=None):
        loads.append((name, device))
        if len(loads) == 2:
            raise _Stop
        return None, None

    monkeypatch.setattr(cli, "load_model", load_model)
    with pytest.raises(_Stop):
        cli.build(args)
    assert loads == [("./t", expected), ("./d", expected)]


def test_serve_loads_a_local_folder_on_the_device(tmp_path, target):
    pytest.importorskip("fastapi", reason=SERVE_EXTRA)
    from hf_spin.serving import cli

    from .tiny_tokenizers import char_tokenizer

    target.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model, tok = cli.load_model(str(tmp_path), torch.float32, "cpu")
    assert model.device.type == "cpu" and not model.training and tok.padding_side == "left"
    with pytest.raises(SystemExit, match="--device: device='gpu0'"):
        cli.load_model(str(tmp_path), torch.float32, "gpu0")


# -- the attention switch of a model two threads share ----------------------------------------------------

WAIT = 2.0  # seconds a paused forward waits for the other thread before going on alone


def _attention_seen(model, pause=None):
    """Record (thread, attention implementation) at every attention call of `model`; `pause(thread,
    layer)` runs at each, to hold a forward mid-way. Returns the record and the hooks to remove."""
    seen, hooks = [], []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, i=i):
            name = threading.current_thread().name
            seen.append((name, i, model.config._attn_implementation))
            if pause is not None:
                pause(name, i)

        hooks.append(layer.self_attn.register_forward_pre_hook(hook))
    return seen, hooks


def _packed(model, chunk):
    cache = hf_spin.cache.PackedCache(1)
    return hf_spin.cache.forward_packed(model, cache, [chunk])


def _ragged(model, chunk):
    cache = hf_spin.cache.RectangularCache(torch.zeros(1, 0, dtype=torch.bool))
    return hf_spin.cache.forward_ragged(model, cache, [chunk])


def _run_together(first, second, pause):
    """`first` on thread "a", then `second` on thread "b" once "a" is inside its forward."""
    results = {}
    threads = [
        threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f()), name=n)
        for n, f in (("a", first), ("b", second))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_a_packed_forward_does_not_switch_the_attention_of_another_threads_forward(target):
    """Thread a verifies on packed rows (hf_spin_varlen); thread b drafts with the same model on a
    rectangular cache meanwhile: b runs under the model's own attention, before or after a's switch."""
    home = target.config._attn_implementation
    chunk = [5, 6, 7]
    ref_packed, ref_ragged = _packed(target, chunk), _ragged(target, chunk)
    a_inside, b_done = threading.Event(), threading.Event()

    def pause(name, layer):
        if name == "a" and layer == 0:
            a_inside.set()
            b_done.wait(WAIT)  # with the switch, b waits for a: a goes on after WAIT

    def b():
        a_inside.wait(WAIT)
        try:
            return _ragged(target, chunk)
        finally:
            b_done.set()

    seen, hooks = _attention_seen(target, pause)
    try:
        out = _run_together(lambda: _packed(target, chunk), b, pause)
    finally:
        for h in hooks:
            h.remove()
    assert {impl for name, _, impl in seen if name == "b"} == {home}, seen
    assert {impl for name, _, impl in seen if name == "a"} == {"hf_spin_varlen"}, seen
    assert torch.equal(out["a"], ref_packed) and torch.equal(out["b"], ref_ragged)
    assert target.config._attn_implementation == home


def test_two_packed_forwards_keep_the_switch_until_both_are_done(target):
    """a and b both run packed: a finishing first must not switch the attention back under b."""
    home = target.config._attn_implementation
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()

    def pause(name, layer):
        if layer == 0 and name == "a":
            a_inside.set()
            b_inside.wait(WAIT)
        elif layer == 0 and name == "b":
            b_inside.set()
            a_done.wait(WAIT)

    def a():
        try:
            return _packed(target, [5, 6, 7])
        finally:
            a_done.set()

    def b():
        a_inside.wait(WAIT)
        return _packed(target, [8, 9])

    seen, hooks = _attention_seen(target, pause)
    try:
        _run_together(a, b, pause)
    finally:
        for h in hooks:
            h.remove()
    assert [impl for name, _, impl in seen if name == "b"] == ["hf_spin_varlen"] * len(target.model.layers), seen
    assert target.config._attn_implementation == home


# -- CUDA stream ordering in the pipeline ------------------------------------------------------------------


class FakeCuda:
    """torch.cuda's stream API, logging what it is asked: ("record", event, stream), ("wait", stream,
    event), ("wait_stream", waiter, waited, thread). Each thread has its own current stream."""

    class Stream:
        def __init__(self, name, log, device=torch.device("cuda", 0)):
            self.name, self.log, self.device = name, log, device

        def wait_event(self, event):
            self.log.append(("wait", self.name, event.id))

        def wait_stream(self, other):
            self.log.append(("wait_stream", self.name, other.name, threading.current_thread().name))

    class _Event:
        count = 0

        def __init__(self, log):
            FakeCuda._Event.count += 1
            self.id, self.log = FakeCuda._Event.count, log

        def record(self, stream):
            self.log.append(("record", self.id, stream.name))

    def __init__(self):
        self.log: list = []
        self.default = FakeCuda.Stream("default", self.log)
        self.local = threading.local()

    def Event(self):  # noqa: N802 - torch.cuda's name
        return FakeCuda._Event(self.log)

    def current_stream(self, device=None):
        return getattr(self.local, "stream", None) or self.default

    def stream(self, stream):
        cuda = self

        class Context:
            def __enter__(self):
                self.previous = getattr(cuda.local, "stream", None)
                cuda.local.stream = stream

            def __exit__(self, *exc):
                cuda.local.stream = self.previous

        return Context()


def test_pipeline_orders_the_drafting_and_target_streams(target, drafter, monkeypatch):
    """With a (simulated) drafting stream: drafts are made on it, after an event of the target's work on
    the lane; verification waits for an event of the drafts; the target thread's own drafter calls
    (rows retired, rows admitted) run on it too, fenced both ways."""
    from hf_spin.step.engine import SpinEngine
    from hf_spin.step.pipeline import Pipeline, _Streams

    from .test_engine import prompts, request, run

    cuda = FakeCuda()
    log = cuda.log
    for method in ("propose", "verify"):
        original = getattr(SpinEngine, method)

        def logged(self, *args, _original=original, _method=method):
            log.append((_method, id(self), cuda.current_stream().name))
            return _original(self, *args)

        monkeypatch.setattr(SpinEngine, method, logged)
    for method in ("start", "add_rows", "select_rows"):
        original = getattr(ModelDrafter, method)

        def logged_drafter(self, *args, _original=original, _method=method, **kwargs):
            log.append(("drafter." + _method, threading.current_thread().name, cuda.current_stream().name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ModelDrafter, method, logged_drafter)
    pipe = Pipeline(target, spin_pool([drafter]), micro_batches=2)
    pipe.streams = _Streams(FakeCuda.Stream("side", log), [torch.device("cuda", 0)], cuda=cuda)
    ps = prompts(4, seed=5)
    rows = run(pipe, {0: [request(p, n) for p, n in zip(ps, [9, 3, 12, 6])]})
    assert all(len(r.generated) == n for r, n in zip(rows, [9, 3, 12, 6]))

    recorded_on = {e[1]: e[2] for e in log if e[0] == "record"}
    proposes = [i for i, e in enumerate(log) if e[0] == "propose"]
    verifies = [i for i, e in enumerate(log) if e[0] == "verify"]
    assert (
        proposes
        and verifies
        and all(log[i][2] == "side" for i in proposes)
        and all(log[i][2] == "default" for i in verifies)
    )
    for i in verifies:  # the default stream waited for an event on "side" recorded after this lane's drafts
        lane = log[i][1]
        drafted = max(j for j in proposes if j < i and log[j][1] == lane)
        waited = [e[2] for e in log[drafted:i] if e[0] == "wait" and e[1] == "default"]
        assert any(recorded_on[ev] == "side" and log.index(("record", ev, "side")) > drafted for ev in waited), log[
            drafted:i
        ]
    for i in proposes:  # the side stream waited for an event on "default" recorded after the lane's last verify
        lane = log[i][1]
        last = max((j for j in verifies if j < i and log[j][1] == lane), default=-1)
        waited = [e[2] for e in log[last + 1 : i] if e[0] == "wait" and e[1] == "side"]
        assert any(recorded_on[ev] == "default" and log.index(("record", ev, "default")) > last for ev in waited), log[
            last + 1 : i
        ]
    calls = [i for i, e in enumerate(log) if e[0].startswith("drafter.")]
    assert {log[i][0] for i in calls} >= {"drafter.start", "drafter.select_rows"}
    assert all(log[i][2] == "side" for i in calls), [log[i] for i in calls]
    main = [
        e[:3]
        for e in log
        if (e[0] == "wait_stream" and e[3] == "MainThread") or (e[0].startswith("drafter.") and e[1] == "MainThread")
    ]
    assert main, "the target thread made no drafter call"
    for i, e in enumerate(main):  # from the target thread: fenced both ways
        if e[0].startswith("drafter."):
            assert main[i - 1] == ("wait_stream", "side", "default") and main[i + 1] == (
                "wait_stream",
                "default",
                "side",
            ), main


def test_q_made_on_the_drafting_stream_is_recorded_on_the_target_stream():
    from types import SimpleNamespace

    from hf_spin.step.pipeline import _Streams

    cuda = FakeCuda()
    streams = _Streams(FakeCuda.Stream("side", cuda.log), [torch.device("cuda", 0)], cuda=cuda)
    kept = []
    q = SimpleNamespace(device=torch.device("cuda", 0), record_stream=lambda s: kept.append(s.name))
    events = streams.mark()
    streams.wait(events, SimpleNamespace(qs=[q, None]))
    assert kept == ["default"] and ("wait", "default", events[0].id) in cuda.log


# -- on a real GPU (skipped without one) -----------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _plain_generate(model, prompt, n):
    ids = torch.tensor([prompt], device=model.device)
    return model.generate(input_ids=ids, max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


def split_over_devices(model, main: str = "cuda"):
    """`model` with its last decoder layer on the CPU and the rest on `main`, as a device_map spreads a
    model: accelerate's hook moves the layer's inputs there and its output back, so that layer's KV
    lives on the CPU while the others' lives on the GPU."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model.to(main)
    layer = model.model.layers[-1].to("cpu")
    add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("cpu"), io_same_device=True))
    return model


@needs_cuda
@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_cuda_pipeline_greedy_equals_plain_generate(cache):
    """Drafting on a side stream of the GPU while the target verifies on the default one."""
    from hf_spin.step.pipeline import Pipeline

    from .archs import tiny_model
    from .speculation import perturbed
    from .test_engine import prompts, request, run

    target, draft = tiny_model("llama", seed=0).cuda(), perturbed("llama").cuda()
    pipe = Pipeline(target, spin_pool([draft, "prompt_lookup"], policy="round_robin", cache=cache), micro_batches=2)
    assert pipe.streams.stream is not None
    ps, lengths = prompts(6, seed=11), [18, 6, 14, 20, 9, 3]
    rows = run(
        pipe,
        {
            0: [request(ps[i], lengths[i]) for i in range(4)],
            3: [request(ps[4], lengths[4]), request(ps[5], lengths[5])],
        },
    )
    for row, p, n in zip(rows, ps, lengths):
        assert row.generated == _plain_generate(target, p, n)[: len(row.generated)] and len(row.generated) in (
            n,
            len(_plain_generate(target, p, n)),
        )
    assert_speculated(hf_spin.stats.DrafterStats.total(pipe.drafter_stats.values()))


@needs_cuda
def test_cuda_target_with_a_cpu_drafter_under_processors():
    """Target on the GPU, drafter on the CPU: the target's processors hold CUDA tensors."""
    from .archs import tiny_model
    from .speculation import perturbed

    target, draft = tiny_model("llama", seed=0).cuda(), perturbed("llama")
    ids, mask = ragged_batch(2, 8)
    kwargs = dict(
        input_ids=ids.cuda(),
        attention_mask=mask.cuda(),
        max_new_tokens=15,
        do_sample=False,
        repetition_penalty=1.3,
        min_new_tokens=10,
    )
    pool = spin_pool([draft])
    assert torch.equal(spin(target, pool, **kwargs), target.generate(**kwargs))
    assert_speculated(pool.last_stats)


@needs_cuda
@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_cuda_model_split_over_devices_keeps_its_caches_exact(cache):
    """Layers on two devices: compaction, rows leaving the batch and packed relayouts index each
    layer's KV where it lives; the packed path reads the metadata on each layer's device."""
    from .archs import EOS, tiny_model
    from .speculation import perturbed

    target = split_over_devices(tiny_model("llama", seed=0))
    draft = split_over_devices(perturbed("llama"))
    ids, mask = ragged_batch(4, 10, seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    eos = [EOS, int(ref[0, 14]), int(ref[2, 18])]  # rows stop at different steps: retirement
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    pool = spin_pool([draft], cache=cache)
    out = spin(target, pool, **kwargs)
    assert target.model.layers[-1].self_attn.q_proj.weight.device.type == "cpu"
    assert torch.equal(out, target.generate(**kwargs))
    assert_speculated(pool.last_stats)
