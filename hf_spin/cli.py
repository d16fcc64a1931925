"""The `hf-spin` command (also `python -m hf_spin`).

hf-spin serve [options]      an HTTP server with TGI's routes and OpenAI-compatible completions
                             (a Whisper model: OpenAI-compatible transcriptions)
                             (`hf-spin serve --help` lists the options)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-spin", description="hf_spin: lossless speculative decoding with a pool of drafters"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP (TGI routes, OpenAI-compatible completions; transcriptions for Whisper)",
        description="Serve a model over HTTP: TGI's /generate, /generate_stream, /health, /info, /metrics "
        "and OpenAI-compatible /v1/completions and /v1/chat/completions.",
    )
    try:
        from .serving import cli as serving_cli
    except ImportError as err:  # fastapi & co. are the `serve` extra
        serving_cli = None
        missing = err
    if serving_cli is not None:
        serving_cli.add_arguments(serve)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    if serving_cli is None:
        sys.exit(
            f"hf-spin serve needs the serving packages ({missing}); install them with: pip install 'hf-spin[serve]'"
        )
    serving_cli.serve(args)


if __name__ == "__main__":
    main()
