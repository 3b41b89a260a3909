"""Fuzz a running mlxq server with OpenAI's own OpenAPI spec (schemathesis).

Generates spec-valid requests for chat completions, completions, models and
responses, and checks every answer: no 5xx, and every 2xx body conforms to the
spec's response schema. The spec is not shipped (3 MB): pass its path, e.g.
openapi.json from github.com/openai/openai-openapi.

    mlxq serve --port 8080 &
    python scripts/schemathesis_openai.py openapi.json --url http://127.0.0.1:8080 --max-examples 50

schemathesis 4.32 reports one ST108 on streamed /responses that is its own reading: it
validates the SSE envelope ({"event", "data"}) of streams that name their events, where the
spec's schema describes each event's data (every event's data validates against
ResponseStreamEvent with jsonschema-rs). Other options go to ``st run`` unchanged
(``--output-sanitize false`` shows whole bodies).
Exit status is schemathesis's: 0 when every check passed. Needs
``pip install schemathesis``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

# The routes mlxq serves that the spec describes (the spec's paths have no /v1: it is the server URL).
PATHS = r"^/(chat/completions|completions|models|models/\{model\}|responses)$"
CHECKS = "not_a_server_error,response_schema_conformance"


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
    return subprocess.call(command(args.spec, args.url, args.max_examples, args.seed, args.workers) + extra)


if __name__ == "__main__":
    raise SystemExit(main())
