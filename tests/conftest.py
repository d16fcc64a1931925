"""Test-session set-up.

Pools are built with profile="off" unless a test says otherwise (see below).

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, and `triton.language` decorates
its own helpers (`tl.maximum`, `tl.minimum`, ...) when triton is first imported. For the kernel tests to
run on a machine without a GPU, triton must therefore be imported with TRITON_INTERPRET=1 before any
test module imports it. The variable is restored right after, so the rest of the suite keeps the fast
PyTorch reference path on CPU; tests/test_kernels.py sets it again while its own tests run (the
dispatcher reads it at call time, and the launcher re-wraps hf_spin's kernels for the interpreter).
"""

import importlib.util
import os
import sys

import pytest
import torch

# Pools in tests decode with the policy's k as given (profile "off"): a measured cost profile of a tiny
# random model is timing noise, and the lossless tests must draft on any machine. The planner's tests
# pass injected costs (tests/test_planning.py).
os.environ.setdefault("HF_SPIN_PROFILE", "off")

if not torch.cuda.is_available() and "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread: with two, OpenMP hand-offs cost more than the matmuls
    (100x slower when another process shares the cores). Same thread count on both sides of a compare."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied and its counters zeroed (reset leaves the counters)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def target():
    """A tiny random llama: the target of the feature, engine, pipeline and server tests."""
    from .archs import tiny_model

    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def drafter():
    """The target with noise on its weights: drafts of several tokens, often accepted, not always."""
    from .speculation import perturbed

    return perturbed("llama")
