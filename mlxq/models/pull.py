"""`mlxq model pull`: a thin wrapper over huggingface_hub's snapshot download.

The download lands in the Hugging Face cache, the place `mlxq serve --model REPO`
looks (offline) — so pulling once is the whole set-up for a real model. HF_ENDPOINT,
HF_HOME and HF_TOKEN apply as for the `hf` command.
"""

from __future__ import annotations

from pathlib import Path

# What a model directory needs; other files in a repo (READMEs, images, other formats) are skipped.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]


class PullError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def pull_model(repo: str, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if repo.count("/") != 1 or repo.startswith(("/", ".", "~")):
        raise PullError(f"{repo!r} is not a repo id (owner/name)", 2)
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES))
    except RevisionNotFoundError:
        raise PullError(f"{repo} has no revision {revision!r}", 2) from None
    except RepositoryNotFoundError:
        raise PullError(f"no repo {repo!r} on the hub (or it needs a token: set HF_TOKEN)", 2) from None
    except (HfHubHTTPError, OSError) as exc:
        raise PullError(f"could not download {repo}: {exc}", 1) from None
    if not (path / "config.json").exists():
        raise PullError(f"{repo} was downloaded to {path} but has no config.json: not a model repo", 2)
    return path
