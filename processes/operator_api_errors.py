"""The operator API's refusals: a request it will not or cannot do, answered as JSON with its HTTP status."""

from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    """A request the API will not or cannot do: its HTTP status, the reason said in the JSON body, headers."""

    def __init__(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(text)
        self.status, self.text, self.headers = status, text, headers or {}

    def response(self) -> web.Response:
        return web.json_response({"error": self.text}, status=self.status, headers=self.headers)
