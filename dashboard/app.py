"""The dashboard's web app: FastAPI routes, Jinja2 pages, the token check, static files.

Built by ``create_app(settings)`` for ``spanrl dashboard`` (``dashboard_cli.py``) and tests.
Read-only: every route only reads the store (opened ``mode=ro``) and the run's output folder.
Pages are rendered on the server; the run page then polls ``/api/run`` every ``refresh_s``
and redraws its charts (Chart.js, shipped in ``static/vendor/``: no CDN, works offline).
While it runs, a thread keeps the facet index of the rollouts page (``facet_index.py``).
Bad query values answer 400 with a page naming the field; a rollout the store lacks, 404.
"""

from __future__ import annotations

import hmac
import math
import os
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from markupsafe import Markup, escape

from . import pages
from .facet_index import FacetIndex, FacetIndexer
from .settings import DashboardSettings
from .store_reader import KINDS, SORTS, STATUSES, RolloutFilter

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN_COOKIE = "spanrl_dashboard_token"
OPEN_PATHS = ("/favicon.ico",)


class BadQuery(ValueError):
    """A query parameter that cannot be used; the message names it."""


def _optional(request: Request, name: str, kind: type, choices: Any = None) -> Any:
    raw = request.query_params.get(name, "").strip()
    if raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError as exc:
        raise BadQuery(f"{name} must be {'a number' if kind is float else 'a whole number'}, got {raw!r}") from exc
    if kind is float and not math.isfinite(value):
        raise BadQuery(f"{name} must be a finite number, got {raw!r}")
    if choices is not None and value not in choices:
        raise BadQuery(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return value


def rollout_filter(request: Request) -> tuple[RolloutFilter, int]:
    """The rollouts page's filters and page number from its query string."""
    step = _optional(request, "step", int)
    page = _optional(request, "page", int)
    page = 1 if page is None else page
    if page < 1:
        raise BadQuery(f"page must be 1 or more, got {page}")
    return RolloutFilter(
        step=step, task=_optional(request, "task", str), status=_optional(request, "status", str, STATUSES),
        agent=_optional(request, "agent", str), kind=_optional(request, "kind", str, KINDS),
        reward_min=_optional(request, "reward_min", float), reward_max=_optional(request, "reward_max", float),
        sort=_optional(request, "sort", str, tuple(SORTS)) or "newest",
    ), page


def _token_ok(request: Request, token: str) -> bool:
    given = request.cookies.get(TOKEN_COOKIE, "")
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        given = header[7:].strip()
    return hmac.compare_digest(given.encode(), token.encode())


def create_app(settings: DashboardSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.indexer = FacetIndexer(settings.store, settings.refresh_s).start()
        try:
            yield
        finally:
            app.state.indexer.stop()

    app = FastAPI(title="spanrl dashboard", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.settings = settings

    def index() -> FacetIndex | None:
        indexer = getattr(app.state, "indexer", None)
        return None if indexer is None else indexer.index

    templates = Jinja2Templates(directory=os.path.join(HERE, "templates"))
    templates.env.globals.update(settings=settings, fmt=format_number)
    templates.env.filters["exact"] = exact_text
    app.mount("/static", StaticFiles(directory=os.path.join(HERE, "static")), name="static")

    def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        return templates.TemplateResponse(request, name, context, status_code=status)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if settings.token is None or request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), settings.token.encode()):
            # keep the token out of the address bar and history: a cookie carries it from now on
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + ("?" + urlencode(rest) if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(TOKEN_COOKIE, settings.token, httponly=True, samesite="strict")
            return response
        if not _token_ok(request, settings.token):
            return HTMLResponse("<h1>401: this dashboard needs its token</h1><p>Open it with ?token=TOKEN "
                                "(the --token it was started with).</p>", status_code=401)
        return await call_next(request)

    @app.exception_handler(BadQuery)
    async def bad_query(request: Request, exc: BadQuery) -> Response:
        return page(request, "problem.html", {"title": "Bad request", "problems": [str(exc)]}, 400)

    @app.get("/")
    def home() -> Response:
        return RedirectResponse("/run", status_code=307)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/run")
    def run(request: Request) -> Response:
        return page(request, "run.html", {"title": "Run", "data": pages.run_data(settings)})

    @app.get("/api/run")
    def run_json(request: Request) -> Response:
        return JSONResponse(pages.run_data(settings, _optional(request, "agents_step", int)))

    @app.get("/rollouts")
    def rollouts(request: Request) -> Response:
        filters, number = rollout_filter(request)
        data = pages.rollouts_data(settings, filters, number, index())
        query = {k: v for k, v in request.query_params.items() if k != "page" and v}
        return page(request, "rollouts.html", {
            "title": "Rollouts", "data": data, "filters": filters, "statuses": STATUSES, "kinds": KINDS,
            "sorts": list(SORTS), "page_url": lambda n: "/rollouts?" + urlencode({**query, "page": n}),
        })

    @app.get("/rollouts/{rollout_id:path}")
    def rollout(request: Request, rollout_id: str) -> Response:
        data = pages.rollout_data(settings, rollout_id)
        if data is None:
            return page(request, "problem.html", {"title": "No such rollout", "problems": [
                f"the store {settings.store} has no rollout {rollout_id!r}"]}, 404)
        return page(request, "rollout.html", {"title": f"Rollout {rollout_id}", **data})

    @app.get("/validation")
    def validation(request: Request) -> Response:
        return page(request, "validation.html", {"title": "Validation", **pages.validation_data(settings)})

    @app.get("/compare")
    def compare(request: Request) -> Response:
        data = pages.compare_data(settings, _optional(request, "task", str), _optional(request, "a", int),
                                  _optional(request, "b", int), index())
        return page(request, "compare.html", {"title": "Compare steps", **data})

    return app


def exact_text(text: str) -> Markup:
    """Model text for HTML, escaped, with carriage returns as character references: an HTML
    parser turns a literal CR into a line feed, but keeps ``&#13;``. NUL cannot be kept: in body
    text a parser drops it (a sampled NUL token would vanish from the page), so it is shown as
    U+FFFD, the replacement character."""
    return Markup(str(escape(text)).replace("\r", "&#13;").replace("\x00", "\ufffd"))


def format_number(value: Any, digits: int = 3) -> str:
    """A number for a table cell: ``-`` for none, up to ``digits`` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)
