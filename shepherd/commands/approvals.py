"""``shepherd approvals``: the requests the operator API's policy gives to two people, waiting for the second; and
``--approve ID`` / ``--refuse ID``, a second operator's decision, which does the request as it was asked or drops it.

Approvals live in the operator API (api_url): a request sent straight to Temporal has none.
"""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from foundation.settings import Settings
from operations.api_client import ApiOperatorClient
from shepherd.commands.base import Subcommands, UsageError, add_common, operate_api, show


def register(commands: Subcommands) -> None:
    """Add ``shepherd approvals`` to the commands."""
    parser = commands.add_parser(
        "approvals", help="requests waiting for a second operator; --approve or --refuse one (operator API)"
    )
    add_common(parser)
    decide = parser.add_mutually_exclusive_group()
    decide.add_argument("--approve", metavar="ID", help="do the request as it was asked, as the second operator")
    decide.add_argument("--refuse", metavar="ID", help="drop the request, as the second operator")
    parser.add_argument("--json", action="store_true", help="JSON instead of lines")
    parser.set_defaults(run=run)


def format_approvals(approvals: list[dict[str, Any]]) -> list[str]:
    """A line for each approval waiting, and its body below; or that none waits."""
    if not approvals:
        return ["no request waits for a second operator"]
    lines = []
    for approval in approvals:
        lines.append(
            f"{approval['approval_id']}  {approval['target']}, asked by {approval['asked_by']}, "
            f"until {approval['expires_at'][:19].replace('T', ' ')} UTC"
        )
        lines.append(f"  {approval['body']}")
    return lines


def run(settings: Settings, args: argparse.Namespace) -> int:
    """List the approvals waiting, or decide one."""
    if not settings.api_url:
        raise UsageError("approvals are the operator API's: set api_url (SHEPHERD_API_URL)")
    chosen = args.approve or args.refuse
    if chosen is None:

        async def listing(api: ApiOperatorClient) -> Any:
            return await api.call("GET", "/v1/approvals")

        approvals = operate_api(settings, listing)
        return show(None, args.json, lambda: approvals, lambda: format_approvals(approvals))
    verb = "approve" if args.approve else "refuse"

    async def deciding(api: ApiOperatorClient) -> Any:
        return await api.call("POST", f"/v1/approvals/{quote(chosen, safe='')}/{verb}", {})

    answer = operate_api(settings, deciding)
    return show(None, args.json, lambda: answer, lambda: [_answer_line(answer)])


def _answer_line(answer: Any) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("answer"), str):
        return str(answer["answer"])
    if isinstance(answer, dict) and isinstance(answer.get("summary"), str):
        return str(answer["summary"])
    return str(answer)
