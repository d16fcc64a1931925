"""`hf-spin serve`: load the target and drafters, build the app, run it under uvicorn.

    hf-spin serve                                   # packaged Qwen2.5-Coder-1.5B, drafters Qwen-0.5B + prompt lookup
    hf-spin serve --model ./my-model --drafter ./my-draft --drafter prompt_lookup --policy fixed --port 9000
    hf-spin serve --no-speculation                  # plain batched decoding (the baseline)
    hf-spin serve --pipeline auto                   # micro-batches chosen by Spin's heuristic
    hf-spin serve --device auto                     # every model split over the GPUs (default: cuda if present)
    hf-spin serve --model whisper-base --dtype float32   # audio: POST /v1/audio/transcriptions, prompt lookup

A model or drafter is a packaged model name (`hf_spin.models.NAMES`, `hf_spin.speech_models.NAMES`), a
local folder with a `transformers` model and tokenizer (a Whisper folder: and its feature extractor), or
(drafters only) `prompt_lookup`. A Whisper target serves audio instead of text; a packaged Whisper
drafting for another packaged Whisper is re-indexed into the target's vocabulary
(`speech_models.load_remapped_drafter`). Binds 127.0.0.1 unless told otherwise. The API key comes from
`--api-key` or `$HF_SPIN_API_KEY`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTERS = ("qwen2.5-coder-0.5b-instruct", "prompt_lookup")
# a Whisper target's: no second model to load (`--drafter whisper-tiny.en` adds tiny.en, re-indexed, for whisper-base)
DEFAULT_SPEECH_DRAFTERS = ("prompt_lookup",)
DEFAULT_POLICY = "round_robin"
API_KEY_ENV = "HF_SPIN_API_KEY"
DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .. import models, speech_models
    from ..pool import CACHE_LAYOUTS, NAMED_DRAFTERS

    names = ", ".join(models.NAMES + speech_models.NAMES)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 to listen on every interface)",
    )
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"target: a packaged model ({names}) or a local folder (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--drafter",
        action="append",
        default=None,
        help=(
            f"a drafter, repeatable: a packaged model, a local folder, or one of {sorted(NAMED_DRAFTERS)} "
            f"(default: {' and '.join(DEFAULT_DRAFTERS)}; "
            f"for a Whisper target: {' and '.join(DEFAULT_SPEECH_DRAFTERS)})"
        ),
    )
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"drafter selection policy, a name from hf_spin.policies.POLICIES (default {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--draft-length", default="5", help="tokens drafted per step: an int or a draft-length rule name (default 5)"
    )
    p.add_argument("--no-speculation", action="store_true", help="serve without drafters: plain batched decoding")
    p.add_argument(
        "--pipeline",
        default="off",
        help="micro-batch pipelining: off (default), auto (Spin's heuristic) or a number of micro-batches",
    )
    p.add_argument(
        "--cache",
        default="rectangular",
        choices=CACHE_LAYOUTS,
        help="KV cache layout (AssistantPool(cache=...)): rectangular (default) or packed",
    )
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="model dtype (default bfloat16)")
    p.add_argument(
        "--device",
        default=None,
        help=(
            "where the models go: cpu, cuda, cuda:N, or a device map (auto: split over every GPU); "
            "default cuda when a GPU is there, else cpu"
        ),
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help=(
            "torch threads for the models (default: torch's choice); "
            "with --pipeline on a CPU, split between target and drafting threads"
        ),
    )
    p.add_argument("--max-batch-size", type=int, default=16, help="rows decoding together (default 16)")
    p.add_argument(
        "--max-batch-prefill-tokens",
        type=int,
        default=4096,
        help=(
            "prompt tokens one step may prefill (joining rows x longest prompt; a longer prompt joins alone; "
            "default 4096)"
        ),
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting beyond the batch; more get 503 + Retry-After (default 64)",
    )
    p.add_argument("--max-input-tokens", type=int, default=4096, help="longest prompt in tokens (default 4096)")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="prompt + max_new_tokens limit (default 8192)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else no key)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds running requests may finish at shutdown (default 10)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _pipeline(value: str) -> bool | int:
    if value == "off":
        return False
    if value == "auto":
        return True
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise SystemExit(f"--pipeline must be off, auto or a positive number of micro-batches, got {value!r}")


def _placement(device):
    """`models.device_map(device)`, a bad one refused as a command-line error."""
    from .. import models

    try:
        return models.device_map(device)
    except ValueError as err:
        raise SystemExit(f"--device: {err}") from None


def load_model(name: str, dtype, device=None):
    """(model, tokenizer) of a packaged model name or a local folder, on `device` (`models.device_map`)."""
    from .. import models

    placement = _placement(device)
    if name in models.NAMES:
        return models.load(name, dtype=dtype, device=device)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise SystemExit(
            f"--model/--drafter {name!r} is neither a packaged model ({', '.join(models.NAMES)}) nor a folder"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=placement).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    return model, tokenizer


def load_target(name: str, dtype, device=None):
    """(model, tokenizer, feature extractor or None) of a packaged model name or a local folder: a Whisper
    model (packaged, or a folder whose config says so) comes with its feature extractor, any other without."""
    from .. import speech_models

    if name in speech_models.NAMES:
        _placement(device)
        model, processor = speech_models.load(name, dtype=dtype, device=device)
        return model, processor.tokenizer, processor.feature_extractor
    config = Path(name).expanduser() / "config.json"
    if not (config.is_file() and json.loads(config.read_text()).get("model_type") == "whisper"):
        return (*load_model(name, dtype, device), None)
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq, AutoTokenizer

    placement = _placement(device)
    model = AutoModelForSpeechSeq2Seq.from_pretrained(config.parent, dtype=dtype, device_map=placement).eval()
    return model, AutoTokenizer.from_pretrained(config.parent), AutoFeatureExtractor.from_pretrained(config.parent)


def load_drafter(name: str, target: str, dtype, device=None):
    """A pool entry: (model, tokenizer), or a packaged Whisper re-indexed into a packaged Whisper target's
    vocabulary (a bare model: it drafts in the target's ids)."""
    from .. import speech_models

    if name in speech_models.NAMES and target in speech_models.NAMES and name != target:
        return speech_models.load_remapped_drafter(name, target, dtype, device=device)
    draft, draft_tok, _ = load_target(name, dtype, device)
    return draft, draft_tok  # the pool skips translation when the tokenizers match


def build(args):
    """The app for these arguments (loads every model)."""
    import torch

    from .. import AssistantPool
    from ..pool import NAMED_DRAFTERS
    from . import Limits, build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer, feature_extractor = load_target(args.model, dtype, args.device)
    pool = None
    if not args.no_speculation:
        entries = []
        defaults = DEFAULT_DRAFTERS if feature_extractor is None else DEFAULT_SPEECH_DRAFTERS
        for name in args.drafter or defaults:
            if name in NAMED_DRAFTERS:
                entries.append(name)
            else:
                entries.append(load_drafter(name, args.model, dtype, args.device))
        length = int(args.draft_length) if args.draft_length.isdigit() else args.draft_length
        pool = AssistantPool(entries, policy=args.policy, draft_length=length, tokenizer=tokenizer, cache=args.cache)
        pool.bind(model, tokenizer)  # refuse a bad pool now, not at the first request
    pipeline = _pipeline(args.pipeline)
    threads, draft_threads = args.threads, None
    if pipeline and args.threads and model.device.type == "cpu":  # two threads of work share the cores
        threads, draft_threads = max(1, args.threads - args.threads // 2), max(1, args.threads // 2)
    return build_app(
        model,
        tokenizer,
        pool,
        model_id=args.model,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        limits=Limits(max_input_tokens=args.max_input_tokens, max_total_tokens=args.max_total_tokens),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        pipeline=pipeline,
        threads=threads,
        draft_threads=draft_threads,
        shutdown_grace_seconds=args.shutdown_grace,
        feature_extractor=feature_extractor,
    )


def serve(args) -> None:
    from ..heap import freeze_gc
    from .server import Server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build(args)
    logging.getLogger(__name__).info("froze %d objects out of the garbage collector's scans", freeze_gc())
    Server(app, host=args.host, port=args.port, log_level=args.log_level).run()
