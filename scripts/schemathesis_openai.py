"""Fuzz a running mlxq server with OpenAI's own OpenAPI spec (schemathesis).

Generates spec-valid requests for chat completions, completions, models and
responses, and checks every answer: no 5xx, every JSON body conforms to the
spec's response schema, and every event of a streamed answer carries data
conforming to the spec's stream schema (scripts/schemathesis_sse.py: chat
chunks against CreateChatCompletionStreamResponse, Responses events against
ResponseStreamEvent with the event name equal to the data's type, streamed
completions against CreateCompletionResponse). The spec is not shipped
(3 MB): pass its path, e.g. openapi.json from github.com/openai/openai-openapi.

    mlxq serve --port 8080 &
    python scripts/schemathesis_openai.py openapi.json --url http://127.0.0.1:8080 --max-examples 50

At the end it prints the answers by status class and the events validated
per route. Other options go to ``st run`` unchanged (``--output-sanitize
false`` shows whole bodies). Exit status is schemathesis's: 0 when every
check passed. Needs ``pip install .[fuzz]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The routes mlxq serves that the spec describes (the spec's paths have no /v1: it is the server URL).
PATHS = r"^/(chat/completions|completions|models|models/\{model\}|responses)$"
CHECKS = "not_a_server_error,response_schema_conformance,sse_events"
HOOKS = "schemathesis_sse"  # this directory's hooks module: stream schemas per event, and the counts


def command(spec: str, url: str, max_examples: int, seed: int, workers: int) -> list[str]:
    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        sys.exit("schemathesis is not installed: pip install schemathesis")
    return [st, "run", spec, "--url", url.rstrip("/") + "/v1", "--include-path-regex", PATHS,
            "--checks", CHECKS, "--mode", "positive", "--max-examples", str(max_examples), "--seed", str(seed),
            "--workers", str(workers), "--request-timeout", "120", "--suppress-health-check", "all",
            "--header", "Authorization: Bearer unused"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="path to OpenAI's openapi.json or openapi.yaml")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the mlxq server (without /v1)")
    parser.add_argument("--max-examples", type=int, default=50, help="requests per operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    args, extra = parser.parse_known_args()  # anything else goes to `st run` as is
    with tempfile.TemporaryDirectory() as tmp:
        tally_path = Path(tmp) / "tally.json"
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "MLXQ_FUZZ_TALLY": str(tally_path),
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        status = subprocess.call(command(args.spec, args.url, args.max_examples, args.seed, args.workers) + extra,
                                 env=env)
        tally = json.loads(tally_path.read_text()) if tally_path.exists() else {}
    print_tally(tally)
    return status


def print_tally(tally: dict) -> None:
    if not tally.get("streams_rewritten"):
        print("warning: no stream schema was rewritten: streamed answers were not validated per event")
    statuses = ", ".join(f"{key[7:]}: {count}" for key, count in sorted(tally.items()) if key.startswith("status_"))
    print(f"answers: {tally.get('responses', 0)} ({statuses})")
    for key, count in sorted(tally.items()):
        if key.startswith("answers "):
            print(f"  {key[8:]}: {count}")
    print(f"streams: {tally.get('streams', 0)}, events validated: {tally.get('events', 0)}")
    for key, count in sorted(tally.items()):
        if key.startswith("events "):
            print(f"  {key[7:]}: {count} events")


if __name__ == "__main__":
    raise SystemExit(main())
