"""Whisper with an assistant pool on real speech: hf_spin against plain `generate`, `transformers`' assisted
generation and the speech pipeline, side by side on the same audio.

    chrt -f 10 python -m benchmarks.whisper_pool [--batch-sizes 1 4] [--draft-vocabulary 8192] [--out DIR]

Target whisper-base, float32, greedy (`language="en", task="transcribe", num_beams=1`); drafter
whisper-tiny.en re-indexed into base's vocabulary (`speech_models.load_remapped_drafter`), with its whole
vocabulary and with a draft vocabulary (`ModelDrafter(draft_vocabulary=N)`), and prompt lookup; every pool
with the cost profile on ("auto"), so the planner decides whether drafting pays on this machine.
Inputs: the five packaged LibriVox utterances (3.0-7.1 s) and the five read as one 24.7 s clip (one of
Whisper's 30 s windows: a long transcript, where decoding outweighs the encoder). Each method runs every
input in the same order within one process, methods interleaved per input (or batch of inputs);
everything is warmed up first (cost profiles measured, cached). Reports per batch size and method: seconds,
ratio to plain `generate`, transcripts identical to plain greedy's, WER against the reference text,
acceptance and tokens per target forward. Then `pipeline("automatic-speech-recognition")` plain and after
`hf_spin.enable()` with the pool, batch_size 1 and 4. Needs the speech packages (docs/speech.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import pipeline

import hf_spin
from hf_spin import speech_models as sm

from .common import machine, write_results

DECODE = dict(language="en", task="transcribe", num_beams=1, do_sample=False)


def inputs(cache: str | None, sdist: str | None) -> list[sm.SpeechSample]:
    """The packaged utterances and all of them as one clip."""
    samples = list(sm.speech_samples(sdist, cache_dir=cache))
    whole = sm.SpeechSample(
        "all five, one clip",
        " ".join(s.text for s in samples),
        np.concatenate([s.audio for s in samples]),
        samples[0].sampling_rate,
    )
    return samples + [whole]


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=None, help="model cache root (default $HF_SPIN_CACHE)")
    parser.add_argument("--sdist", default=None, help="the pocketsphinx-5.1.1.tar.gz (default: under the cache)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--draft-vocabulary", type=int, default=8192, help="ids the cut drafter scores")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the speech pipeline section")
    parser.add_argument("--out", type=Path, default=None, help="write results (json and markdown) here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    where = machine()
    print(f"machine: {where['machine']}; threads {where['threads']}; torch {where['torch']}, float32")
    target, processor = sm.load("whisper-base", torch.float32, args.cache, device="cpu")
    remapped = sm.load_remapped_drafter(cache_dir=args.cache, device="cpu")
    samples = inputs(args.cache, args.sdist)

    def pools() -> dict[str, hf_spin.AssistantPool]:  # fresh per batch size: the planner starts from its profile
        n = args.draft_vocabulary
        return {
            "tiny.en": hf_spin.AssistantPool([hf_spin.EncoderDecoderDrafter(remapped)]),
            f"tiny.en, {n} ids": hf_spin.AssistantPool([hf_spin.EncoderDecoderDrafter(remapped, draft_vocabulary=n)]),
            "prompt lookup": hf_spin.AssistantPool(["prompt_lookup"]),
        }

    def transcribe(group: list[sm.SpeechSample], **kwargs) -> tuple[list[str], float]:
        audio = [s.audio for s in group]
        features = processor(audio, sampling_rate=group[0].sampling_rate, return_tensors="pt").input_features
        start = time.perf_counter()
        with torch.no_grad():
            ids = target.generate(features, **DECODE, **kwargs)
        seconds = time.perf_counter() - start
        return [t.strip() for t in processor.batch_decode(ids, skip_special_tokens=True)], seconds

    rows, results = [], []
    for batch in args.batch_sizes:
        methods = {"plain generate": {}}
        if batch == 1:  # transformers' assisted generation takes one row
            methods["transformers assisted (tiny.en)"] = dict(assistant_model=remapped)
        spin = pools()
        for name, pool in spin.items():
            methods[f"hf_spin [{name}]"] = dict(custom_generate=hf_spin.generate, assistant_pool=pool)
        for kwargs in methods.values():  # warm-up: first calls, cost profiles
            transcribe(samples[:batch], **kwargs)
        texts = {m: [] for m in methods}
        seconds = dict.fromkeys(methods, 0.0)
        stats = {m: [] for m in methods}
        for group in batches(samples, batch):
            for method, kwargs in methods.items():
                out, s = transcribe(group, **kwargs)
                texts[method] += out
                seconds[method] += s
                if "assistant_pool" in kwargs:
                    stats[method].append(kwargs["assistant_pool"].last_stats)
        plain = texts["plain generate"]
        for method in methods:
            errors = [sm.word_errors(s.text, t) for s, t in zip(samples, texts[method])]
            record = {
                "batch": batch,
                "method": method,
                "seconds": seconds[method],
                "ratio": seconds["plain generate"] / seconds[method],
                "identical": sum(a == b for a, b in zip(texts[method], plain)),
                "inputs": len(samples),
                "wer": sum(e for e, _ in errors) / sum(n for _, n in errors),
                "transcripts": texts[method],
            }
            if stats[method]:
                drafted = sum(s.drafters[n].drafted for s in stats[method] for n in s.drafters)
                accepted = sum(s.drafters[n].accepted for s in stats[method] for n in s.drafters)
                forwards = sum(r.target_forwards for s in stats[method] for r in s.rows)
                new = sum(s.new_tokens for s in stats[method])
                record |= {"drafted": drafted, "accepted": accepted, "tokens_per_forward": new / max(forwards, 1)}
            results.append(record)
            rows.append(
                f"| {batch} | {method} | {record['seconds']:.2f} | {record['ratio']:.2f} | "
                f"{record['identical']}/{record['inputs']} | {record['wer']:.3f} | "
                + (
                    f"{record['accepted']}/{record['drafted']} | {record['tokens_per_forward']:.2f} |"
                    if "drafted" in record
                    else "- | 1.00 |"
                )
            )
            print(rows[-1], flush=True)

    if not args.no_pipeline:
        rows += pipeline_rows(target, processor, samples, pools()[f"tiny.en, {args.draft_vocabulary} ids"], results)
    header = (
        f"whisper-base target, float32, greedy; {where['machine']}, {where['threads']} threads, torch {where['torch']},"
        f" transformers {where['transformers']}\n\n"
        "| batch | method | seconds | x plain | identical | WER | accepted/drafted | tokens/forward |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "\n".join(rows) + "\n"
    print("\n" + table)
    if args.out:
        print("wrote", write_results(args.out, "whisper_pool", {"machine": where, "results": results}, table))


def pipeline_rows(target, processor, samples, pool, results: list) -> list[str]:
    """The speech pipeline plain and after `hf_spin.enable()` with `pool`, batch_size 1 and 4, timed on the
    same audio; markdown rows."""
    asr = pipeline(
        "automatic-speech-recognition",
        model=target,
        tokenizer=processor.tokenizer,
        feature_extractor=processor.feature_extractor,
        device="cpu",
    )
    audio = [{"raw": s.audio, "sampling_rate": s.sampling_rate} for s in samples]
    out = []
    for batch in (1, 4):
        timed = {}
        for label, extra in (("pipeline", {}), ("pipeline + hf_spin", {"assistant_pool": pool})):
            kwargs = {**DECODE, **extra}
            hf_spin.enable()
            try:
                asr([dict(a) for a in audio[:batch]], batch_size=batch, generate_kwargs=kwargs)  # warm-up
                start = time.perf_counter()
                done = asr([dict(a) for a in audio], batch_size=batch, generate_kwargs=kwargs)
                texts = [o["text"].strip() for o in done]
                timed[label] = (texts, time.perf_counter() - start)
            finally:
                hf_spin.disable()
        plain_texts, plain_seconds = timed["pipeline"]
        for label, (texts, seconds) in timed.items():
            same = sum(a == b for a, b in zip(texts, plain_texts))
            errors = [sm.word_errors(s.text, t) for s, t in zip(samples, texts)]
            wer = sum(e for e, _ in errors) / sum(n for _, n in errors)
            ratio = plain_seconds / seconds
            results.append(
                {"batch": batch, "method": label, "seconds": seconds, "ratio": ratio, "identical": same}
                | {"inputs": len(samples), "wer": wer, "transcripts": texts}
            )
            out.append(f"| {batch} | {label} | {seconds:.2f} | {ratio:.2f} | {same}/{len(texts)} | {wer:.3f} | - | - |")
            print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    main()
