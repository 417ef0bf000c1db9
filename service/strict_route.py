"""The route class of the JSON routes: the body is parsed and checked before FastAPI validates it.

FastAPI's own body parsing uses Python's lenient `json` (NaN, lone surrogates) and then pydantic's
lax validation of vLLM's models (whose validators may already run xgrammar on a constraint).
`StrictJSONRoute` reads the body first and, in order: parses it strictly (moe_serve.service.json_body),
checks booleans and dataclass keys strictly (moe_serve.service.strict_types), and bounds the structured-
output constraints (moe_serve.service.structured_limits; a client that disconnects meanwhile cancels the
check), whose compile verdict it leaves in the scope for moe_serve.service.request_flow (and ends, if the
route never took it). FastAPI then validates the already-parsed value as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from moe_serve.service.json_body import parse_json_body
from moe_serve.service.metrics import CLIENT_CLOSED
from moe_serve.service.streaming import ClientGone, until_disconnect
from moe_serve.service.strict_types import check_strict_types
from moe_serve.service.structured_limits import check_constraints, constraint_specs



class _CheckedRequest(Request):
    """A request whose JSON body was parsed (and checked) before the route's validation."""

    parsed: Any = None

    async def json(self) -> Any:
        return self.parsed


class StrictJSONRoute(APIRoute):
    """APIRoute whose handler checks the JSON body first (routes without a body pass through)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_type = self.body_field.field_info.annotation if self.body_field is not None else None
        if body_type is None:
            return handler

        async def checked_handler(request: Request) -> Response:
            checked = _CheckedRequest(request.scope, request.receive)
            try:
                body = await checked.body()
            except ClientDisconnect:  # gone, or cut off by the body limits (which answer for it)
                return Response(status_code=CLIENT_CLOSED)
            if body:
                checked.parsed = parse_json_body(body)
                check_strict_types(body_type, checked.parsed)
                specs = constraint_specs(checked.parsed)
                if specs:
                    state = request.app.state.server
                    try:
                        await until_disconnect(checked, check_constraints(specs, state.settings,
                                                                          state.grammar_checker))
                    except ClientGone:
                        return Response(status_code=CLIENT_CLOSED)
            return await handler(checked)

        return checked_handler
