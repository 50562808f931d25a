"""Whether W&B holds credentials for the server it would talk to, found the way `wandb.init` finds them
(WANDB_API_KEY, an identity token file, .netrc, W&B's settings files) without a prompt, a request or a write:
wandb's own lookup, `wandb.sdk.lib.wbauth.authenticate_session(prompt=False, update_session=False)` (wandb 0.31;
not public API)."""

from __future__ import annotations


def server() -> str:
    """The W&B server a run would talk to (WANDB_BASE_URL or W&B's settings)."""
    from wandb.sdk import wandb_setup

    return wandb_setup.singleton().settings.base_url


def missing_credentials() -> str | None:
    """None when W&B has credentials for `server()`, else why not, in one sentence."""
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib import wbauth

    host = server()
    try:
        auth = wbauth.authenticate_session(host=host, source="colocated_grpo", prompt=False, update_session=False)
    except AuthenticationError as err:  # a key that cannot be one (e.g. too short), before any request
        return str(err)
    return None if auth is not None else f"none found for {host}"
